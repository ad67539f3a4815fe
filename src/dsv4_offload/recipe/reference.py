"""docs/recipe-reference.md, generated from the recipe and series models.

`dsv4-offload recipe reference` prints it; a test fails when the committed file differs.
"""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from dsv4_offload import recipe as R
from dsv4_offload.recipe.overrides import unwrap

REGENERATE = "dsv4-offload recipe reference > docs/recipe-reference.md"

# the constrained string types of recipe/fields.py, by their validator's name
_NAMED_STR = {"_commit": "commit", "_sha256": "sha256", "_name": "name",
              "_relative_path": "relative path", "_url": "git URL"}

_HEAD = f"""\
# Recipe and series reference

<!-- generated from src/dsv4_offload/recipe/ by `{REGENERATE}`; do not edit -->

A **recipe** (`recipes/*.yaml`, also shipped inside the package) pins everything one
deployment needs. A **series** (`patches/*.yaml`) lists the patches to apply, in order.
Both are validated on load (`dsv4-offload recipe validate [FILE]`): unknown keys are
rejected, and every error is one line naming the file, the line, the field and what to
write instead, with exit code 2. `dsv4-offload recipe schema` prints the JSON schema.

A recipe may start with `extends: <bundled name or file>` and state only what differs:
mappings merge key by key; lists whose items have a `name` (sources, build steps, probes)
merge item by item on it (`remove: true` drops one, `insert_before:`/`insert_after:` place
a new one); any other value replaces the base's.

Override any field without editing the file: `--set KEY=VALUE` (repeatable), before or
after the command. KEY is the spelling `status` prints for a changed field
(`recipe.sources[sglang].commit`, the `recipe.` is optional), or a dotted path with
indices (`sources.1.commit`, `sources[1].commit`); list items with a `name` are addressed
by it (`build.steps[kt-kernel].env.CPUINFER_ARM_SVE`), layer digests by layer
(`conversion.digests.5`). VALUE is read as YAML, flow lists and mappings included
(`--set 'serve.gpu_experts_ladder=[24,16]'`, `--set 'serve.env={{A: "1"}}'`), except that a
field holding a string keeps the text (`--set sources[sglang].commit=1111…`). Mappings
such as `serve.env` take new keys (`--set serve.env.NEWVAR=1`); a key a model does not
have is refused with the nearest valid ones.

Types: *name* is letters, digits, `.`, `_`, `-`; *commit* is 40 lowercase hex digits;
*sha256* is 64; a *relative path* may not leave the workspace (or the series' directory).
"""


_TAIL = """\
## Rules across fields

- `delivery`, `tree_root`, every `submodule_of` and `conversion.digests_manifest.source`
  name a source of the recipe; source names and paths, build-step names and probe names
  are unique.
- `weights.mxfp4.dir` equals `weights.w8a8.dir` without its `-W8A8` suffix: the server
  derives one from the other.
- `serve.chunked_prefill_size` is a positive multiple of `serve.page_size` and at least
  `serve.longest_prompt_tokens` (the NSA compressor needs one chunk to cover the prompt).
- `pipeline.build_jobs + pipeline.convert_jobs_beside_build` is at most `pipeline.cores`
  when both `cores` and `build_jobs` are given.
- `acceptance.determinism_probe` names a probe; `conversion.digests` keys are layers
  `0..layers-1`.
- In a series, `origin` is either `source` + `path` (a file inside a pinned source) or
  `file` (relative to the series file, never leaving its directory); patch names are
  unique.

A series looks like this:

```yaml
schema: 1
name: dsv4-flash
patches:
  - name: kt-kernel-ascend-npu-backend
    target: ktransformers
    origin: {source: cann-recipes-infer, path: integration/.../0001-....patch}
    sha256: 7536…
    strip: 1
    method: plain
    upstream: not-submitted
    description: one line
```
"""


def _type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        for meta in args[1:]:
            name = getattr(getattr(meta, "func", None), "__name__", "")
            if name in _NAMED_STR:
                return _NAMED_STR[name]
        return _type(args[0])
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        rest = [a for a in args if a is not type(None)]
        inner = " or ".join(_type(a) for a in rest)
        return f"{inner} or null" if len(rest) < len(args) else inner
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"map {_type(args[0])} -> {_type(args[1])}"
    if origin is tuple:
        return f"[{', '.join(_type(a) for a in args)}]"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    return getattr(tp, "__name__", str(tp))


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _constraints(info: Any) -> list[str]:
    """Field(gt=..., min_length=..., pattern=...) as words."""
    out = []
    for meta in info.metadata:
        for attr, sign in _BOUNDS:
            if getattr(meta, attr, None) is not None:
                out.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None):
            out.append(f"at least {meta.min_length}")
        if getattr(meta, "pattern", None):
            out.append(f"matches `{meta.pattern}`")
    return out


def _field_type(info: Any) -> str:
    # pydantic moves a field's own Annotated[...] metadata out of its annotation
    text = _type(info.annotation)
    for meta in info.metadata:
        name = getattr(getattr(meta, "func", None), "__name__", "")
        if name in _NAMED_STR:
            text = _NAMED_STR[name] + (" or null" if text.endswith(" or null") else "")
    more = _constraints(info)
    return f"{text}, {', '.join(more)}" if more else text


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    value = info.default
    if value is PydanticUndefined:
        value = info.default_factory() if info.default_factory else None
    if isinstance(value, BaseModel):
        return "see below"
    return f"`{json.dumps(value, default=str)}`"


def _nested(tp: Any) -> list[type[BaseModel]]:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _nested(a)]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section(model: type[BaseModel], where: str) -> str:
    doc = (model.__doc__ or "").strip()
    at = "The top level of the file." if where == "" else f"At `{where}`."
    lines = [f"### {model.__name__}", "", at + (f" {_cell(doc)}" if doc else ""), "",
             "| key | type | default | meaning |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        key = info.alias or name
        lines.append(f"| `{key}` | {_cell(_field_type(info))} | {_cell(_default(info))} "
                     f"| {_cell(info.description or '')} |")
    return "\n".join(lines)


def _walk(model: type[BaseModel], where: str, seen: dict[str, str]) -> list[type[BaseModel]]:
    order = [model]
    for name, info in model.model_fields.items():
        for sub in _nested(info.annotation):
            is_list = typing.get_origin(unwrap(info.annotation)) is list
            path = f"{where}.{info.alias or name}" + ("[]" if is_list else "")
            path = path.lstrip(".")
            if sub.__name__ not in seen:
                seen[sub.__name__] = path
                order += _walk(sub, path, seen)
            else:
                seen[sub.__name__] += f"`, `{path}"
    return order


def reference_markdown() -> str:
    """The whole reference document, from the models."""
    parts = [_HEAD]
    for title, top in (("Recipe", R.Recipe), ("Series", R.Series)):
        seen = {top.__name__: ""}
        models = _walk(top, "", seen)
        parts.append(f"## {title}\n")
        parts.extend(_section(m, seen[m.__name__]) + "\n" for m in models)
    parts.append(_TAIL)
    return "\n".join(parts).rstrip() + "\n"


def json_schema() -> dict[str, Any]:
    """The JSON schema (pydantic's) of a whole recipe, keys spelt as in YAML files.

    A file that `extends:` another states only what differs, so only whole recipes (or
    `recipe show`'s output) validate against it.
    """
    schema = R.Recipe.model_json_schema(by_alias=True)
    schema["properties"]["extends"] = {
        "type": "string", "title": "Extends",
        "description": "a bundled recipe name or a YAML file this one is laid over",
    }
    return schema
