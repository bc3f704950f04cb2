/* The stand-in's own exports, beside NVML's API (whose prototypes come from NVIDIA's nvml.h). */
#ifndef GHDP_STANDIN_H
#define GHDP_STANDIN_H

/* Misuse seen so far (a count over the process's life, since the last reset). */
int ghdpStandinViolationCount(void);
/* The i-th kept violation message (0 = oldest of the last 64); 0 on success, -1 when i is out of range. */
int ghdpStandinViolation(int i, char *buf, unsigned int len);
void ghdpStandinResetViolations(void);
/* Calls of one exported NVML function by its exact symbol name, e.g. "nvmlDeviceGetCount_v2". */
unsigned long long ghdpStandinCallCount(const char *name);
void ghdpStandinResetCallCounts(void);

#endif
