"""Serving: the launch plan (the delivery's launch script as data), the supervisor, the
container engine and the page-cache warm-up."""
