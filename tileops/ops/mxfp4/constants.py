"""The numbers of the MXFP4 format (see `format`), shared by the tile programs and the torch codec.

Kept apart from `format`: the kernels' hash covers the numbers they decode by, not the codec's
torch code, so changing how a weight is quantised does not make tuning records stale.
"""

BLOCK = 32  # elements sharing one scale
E2M1_EMAX = 2  # exponent of the largest E2M1 magnitude (6 = 1.5 * 2^2)
E8M0_BIAS = 127
E8M0_NAN = 255
# The value of each of the 16 codes: magnitude by the low three bits, sign by bit 3.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)

# The prepacked layout's atom (prepack.py): one warp's 16 weight rows x four 16-deep wgmma k-steps.
ATOM_ROWS, ATOM_K = 16, 64
