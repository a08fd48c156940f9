"""Calibration: sweep grids, measurement driver, cost-model fitting, bundled profiles."""
