"""Reports: plotly figures and self-contained HTML reports built from Traces and Metrics."""
