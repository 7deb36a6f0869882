"""Post-resume validation: prove that a resumed run continues exactly where it stopped."""
