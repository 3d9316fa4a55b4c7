"""The shipped data sets, read as package data (the wheel carries sklearn_digits, the demo's); no code."""
