"""Where the work lives: workspace paths, state and lock, and the context a stage receives."""
