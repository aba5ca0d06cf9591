"""The `gobrrr` command: `main` (the parser and the one error path), `checks` (what is checked
before the work starts), `measure` (profile and calibrate)."""
