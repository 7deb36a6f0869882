"""The XIDs that mean a GPU or its board is bad: one catalogue for the node-health XID check
(``health.critical_xids`` defaults to it) and for log triage.

From NVIDIA's XID catalogue: memory (48 double-bit ECC, 63/64 page retirement and row remapping,
92 high single-bit rate, 94/95 contained/uncontained ECC, 140 unrecovered ECC), the board (56-58
display engine and video memory interface, 62 and 65 internal micro-controller halt and video
processor, 68 NVDEC, 69 graphics engine class error, 73 NVENC, 79 fallen off the bus, 80 corrupted
data on the bus, 81 VGA subsystem, 119/120 GSP timeout and error, 121-124 C2C and SPI, 143 init
failure, 154 recovery action changed) and NVLink (74, 144-150). 13, 31, 43 and 45 are usually the
application's fault, not the GPU's.
"""

CRITICAL_XIDS = frozenset(
    {48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 94, 95, 119, 120, 121, 122, 123, 124}
    | {140, 143, 144, 145, 146, 147, 148, 149, 150, 154}
)
