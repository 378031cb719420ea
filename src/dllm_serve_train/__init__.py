"""Training the small demo models: checkable chat tasks and the two training objectives."""
