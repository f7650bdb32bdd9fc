"""The mock applications the worlds are made of (state, tool declarations, handlers); no tasks."""
