"""The version of ddpx, defined here only: CMakeLists.txt, setup.py and ddpx.__version__ read it."""
__version__ = "0.1.0"
