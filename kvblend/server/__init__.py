"""kvblend's OpenAI-compatible HTTP server (`kvblend serve`)."""
