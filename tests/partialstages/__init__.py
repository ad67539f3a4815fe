"""Only a doctor stage: the others are missing, as in a partial implementation."""
