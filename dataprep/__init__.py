"""The dataset commands: the tiny fixture (``data tiny``), checks (``data check``), activations from a
corpus (``data extract``) and teacher explanations for the SFT splits (``data explain``)."""
