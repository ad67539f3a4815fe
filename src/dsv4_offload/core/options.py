"""Typed stage options: the base every stage's ``Options`` model derives from, and `run`'s.

Each stage module declares its options as a frozen model (``stages/convert.py``:
``ConvertOptions``, exported as ``Options``); the command line and `run` build them, and they
cross processes as their wire form (``to_wire``, JSON-able; ``parse`` reads it back). An
option given as None is not given, as it always was: the field's default applies.
"""

from __future__ import annotations

import os
from collections.abc import ItemsView, Mapping
from typing import Annotated, Any, TypeVar, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator

from dsv4_offload.core.errors import InputError


def _path_text(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


OptionsT = TypeVar("OptionsT", bound="StageOptions")

# a path as the command line gives it (text); a Path made by a caller is taken as its text
PathText = Annotated[str, BeforeValidator(_path_text)]
# the interpreter is named where its stage runs (the image's python): no file that crosses
INTERPRETER_OPTION = "python"
# a path option whose file is a secret (an API key): it crosses owner-only, never on argv
SECRET_SUFFIX = "key_file"


def _is_path_text(annotation: Any) -> bool:
    for a in (annotation, *get_args(annotation)):
        if get_origin(a) is Annotated and any(
                getattr(m, "func", None) is _path_text for m in a.__metadata__):
            return True
    return False


class StageOptions(BaseModel):
    """The options of one stage: a frozen model whose fields are the option names."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _none_is_not_given(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if v is not None}
        return data

    def crossing_paths(self) -> dict[str, str]:
        """The files given on this command line that the stage reads, by option name: each
        must be visible where the stage runs (serving/crossing)."""
        given = self.given()
        return {name: str(given[name]) for name, f in type(self).model_fields.items()
                if name in given and name != INTERPRETER_OPTION and _is_path_text(f.annotation)}

    def needs_image(self) -> bool:
        """Whether the stage's work with these options needs the recipe's image (its tools,
        its device view); a stage whose work does not runs on the host and asks no engine."""
        return True

    @classmethod
    def parse(cls: type[OptionsT], stage: str, data: Mapping[str, Any]) -> OptionsT:
        """These options from a mapping (the wire form, a registry row, a scheduler's
        additions); an unknown name or a bad value is an InputError naming stage and name."""
        fields = cls.model_fields
        unknown = [k for k in data if k not in fields]
        if unknown:
            known = ", ".join(sorted(fields)) or "none"
            raise InputError(f"stage '{stage}' has no option '{unknown[0]}' (its options: "
                             f"{known})")
        return cls._checked(stage, data)

    @classmethod
    def _checked(cls: type[OptionsT], stage: str, data: Mapping[str, Any]) -> OptionsT:
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            first = exc.errors()[0]
            name = ".".join(str(p) for p in first["loc"]) or "?"
            raise InputError(f"stage '{stage}': option '{name}' = {first.get('input')!r}: "
                             f"{first['msg']}") from None

    @classmethod
    def shared(cls: type[OptionsT], given: StageOptions | Mapping[str, Any]) -> OptionsT:
        """The options of ``given`` (another stage's, `run`'s, a mapping) that this type
        declares too; the rest is not this stage's and stays behind."""
        values = given.given() if isinstance(given, StageOptions) else dict(given)
        return cls._checked(cls.__name__, {k: v for k, v in values.items()
                                           if k in cls.model_fields})

    @classmethod
    def of(cls: type[OptionsT], given: StageOptions | Mapping[str, Any]) -> OptionsT:
        """``given`` when it is of this type, else the options of it this type declares (a
        context made by hand holds a plain mapping, a fingerprint reads an upstream's)."""
        return given if isinstance(given, cls) else cls.shared(given)

    def given(self) -> dict[str, Any]:
        """The options set explicitly (not left at their defaults), by name."""
        return {name: getattr(self, name) for name in self.model_fields_set}

    def items(self) -> ItemsView[str, Any]:
        """The options given, as (name, value) pairs: for code that lists what it got."""
        return self.given().items()

    def to_wire(self) -> dict[str, Any]:
        """The options given, as JSON-able values: what crosses to another process."""
        return self.model_dump(mode="json", include=set(self.model_fields_set))


class RunOptions(StageOptions):
    """What `run` takes for its stages (--mirror, --device).

    Not a base of the stages' types: each stage declares the ones it reads (fetch its
    mirrors, doctor and serve the device) and `run` hands each stage only those, so a stage's
    options are exactly what it reads and nothing else crosses with them.
    """

    mirrors: tuple[str, ...] = ()
    device: int | None = None


class FollowOptions(StageOptions):
    """The base of the options of a stage that can follow its streams (``FOLLOWS = True``,
    core/registry): a pipelined run sets ``follow`` when it starts the stage beside them."""

    follow: bool = False
