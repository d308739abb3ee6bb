"""The HTTP server: `tinyloop-serve` (granian + FastAPI) speaking the TinyLoop API (docs/api.md)."""
