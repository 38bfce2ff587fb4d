"""A venv as the build steps make and read it: its site-packages, its records and use-ep
(``layout``), its installed files against their RECORDs (``dist_records``), its cuDNN
(``cudnn``)."""
