"""Test support: real Redis servers, tiny models, and API/worker processes on loopback."""
