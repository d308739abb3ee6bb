"""`tinyloop launch`: an interactive launcher for `tinyloop-serve` that can also point a coding client (Codex, Claude
Code, OpenCode, Zed, Qwen Code) at the server it starts. See docs/launch.md."""
