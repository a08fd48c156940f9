"""The `kestrel` console command."""
