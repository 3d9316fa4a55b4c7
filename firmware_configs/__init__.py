"""The shipped device and coordinator profiles, read as package data; no code."""
