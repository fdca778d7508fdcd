"""Grammar constraints (outlines) with rollback."""
