"""Stage implementations: one module per stage, each with run(ctx) -> StageResult."""
