"""The shipped .tflite models, read as package data (``edgefl.resources.shipped``); no code."""
