"""`python -m settings` prints docs/settings.md."""

from settings import table

print(table(), end="")
