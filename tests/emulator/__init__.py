"""Tests of the Google backends against local emulators (marker `emulator`)."""
