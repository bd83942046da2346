"""What keeps a run safe: settings, start, files and failures (README's table says what each holds). A reader adapting
the template may skip this folder: train_distribute.py calls it."""
