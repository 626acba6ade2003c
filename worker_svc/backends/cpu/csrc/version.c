/* What a build of the kernels was made from, read back by native.py (kernel_sources.py: the
 * variant's name and the sources' hash, passed as -D flags by both builds). A library whose hash
 * differs from the sources beside it is stale (a developer's edit) and is rebuilt. */
#ifndef SARATHI_KERNELS_VARIANT
#define SARATHI_KERNELS_VARIANT "unknown"
#endif
#ifndef SARATHI_KERNELS_SOURCE_HASH
#define SARATHI_KERNELS_SOURCE_HASH ""
#endif

const char *sarathi_kernels_variant(void) { return SARATHI_KERNELS_VARIANT; }
const char *sarathi_kernels_source_hash(void) { return SARATHI_KERNELS_SOURCE_HASH; }
