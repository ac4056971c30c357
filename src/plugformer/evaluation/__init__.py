"""Comparing variants honestly: statistics (confidence intervals, paired tests), `plugformer compare` (grid x seeds),
the length-extrapolation study, attention heatmaps and plots of position schemes and training curves.

Scoring one trained model on the embedded task lives in `plugformer.training.evaluation` (`plugformer eval`).
"""
