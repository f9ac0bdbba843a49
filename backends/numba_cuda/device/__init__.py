"""Device code shared by every kernel family: element conversions and raw shared-memory
pointers (convert), inline-PTX intrinsics (intrinsics: mma.sync, ldmatrix, cp.async, warp
shuffles), constants, the kernel prologue (prologue) and the two seams (seams).

Each module imports numba.cuda: import them only after the simulator choice is fixed."""
