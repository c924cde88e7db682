"""TBD. May import nothing of trainer3d."""
