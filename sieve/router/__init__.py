"""The gateway (`sieve router`): one process in front of OpenAI-compatible backends. See app.py."""
