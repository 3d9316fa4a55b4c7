"""Developer tools run from a checkout (never shipped): the model builder and the type check."""
