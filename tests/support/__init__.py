"""Test and bench harness (never shipped): the mosquitto launcher."""
