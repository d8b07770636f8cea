"""Metrics: reduction, data statistics, MoE load balance, trackers and plots."""
