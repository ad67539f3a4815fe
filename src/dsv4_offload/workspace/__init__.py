"""Where the work lives and how commands run: workspace paths, state and lock, the
runner every external command goes through, and the context a stage receives."""
