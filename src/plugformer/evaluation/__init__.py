"""Comparing variants honestly: statistics (confidence intervals, paired tests), `plugformer compare` (grid x seeds),
the length-extrapolation study, attention heatmaps and plots of position schemes and training curves.

`classification` scores sequence classifiers (accuracy with a Wilson interval, macro F1). Scoring a pipeline stage on
the embedded arithmetic task lives beside the stages, in `plugformer.evaluation.scoring` (`plugformer eval`).
"""
