/*
 * libnvidia-ml.so.1 stand-in: NVML's C ABI driven by the simulated node file (docs/simulated-node.md), so the real
 * nvidia-ml-py runs in tests. Built with NVIDIA's nvml.h force-included, so every exported NVML function below is
 * checked against NVIDIA's prototype. Where the real driver would have undefined behaviour (a bad pointer, a foreign
 * handle, a wrong struct version), this library answers an error and records a violation instead.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "standin.h"

#define ENV_NODE "GHDP_NVML_STANDIN_NODE"
#define MAX_GPUS 64
#define MAX_PROCS 32
#define MAX_REG 1024
#define MAX_LIST 512
#define MAX_NAMES 32
#define MAX_MIG 7
#define MAX_LINK_SLOTS 36 /* NVML_NVLINK_MAX_LINKS of the bindings this targets */
#define MAX_SETS 256
#define QUEUE_LEN 256
#define MAX_SET_REGS 64
#define KEEP_VIOLATIONS 64
#define DEVICE_MAGIC 0x6764766eu
#define SET_MAGIC 0x67657673u
#define WHOLE 0xFFFFFFFFu

#define EV_SBE 0x1ull
#define EV_DBE 0x2ull
#define EV_XID 0x8ull
#define EV_UNAVAILABLE 0x4000ull
#define EV_RECOVERY 0x8000ull

/* ---------------------------------------------------------------------------------------------------------------
 * Profiles: what a GPU model has.
 */
typedef struct {
    const char *key;
    const char *name;
    unsigned arch;
    unsigned links;     /* NVLink slots */
    int nvswitch;       /* links beyond the listed peers go to NVSwitches */
    int nobridge;       /* slots exist but none ever trains */
    int remap;          /* row remapping (else NOT_SUPPORTED) */
    int retired;        /* page retirement (else NOT_SUPPORTED) */
    int fabric;         /* nvmlDeviceGetGpuFabricInfoV */
    int mig;            /* MIG capable */
    unsigned gen, width;
    unsigned pci_device_id;
    int brand;
} profile_t;

static const profile_t PROFILES[] = {
    {"a100-sxm", "NVIDIA A100-SXM4-80GB", NVML_DEVICE_ARCH_AMPERE, 12, 1, 0, 1, 0, 0, 1, 4, 16, 0x20B210DE,
     NVML_BRAND_NVIDIA},
    {"h100-sxm", "NVIDIA H100 80GB HBM3", NVML_DEVICE_ARCH_HOPPER, 18, 1, 0, 1, 0, 1, 1, 5, 16, 0x233010DE,
     NVML_BRAND_NVIDIA},
    {"h100-pcie", "NVIDIA H100 PCIe", NVML_DEVICE_ARCH_HOPPER, 18, 0, 1, 1, 0, 0, 1, 5, 16, 0x233110DE,
     NVML_BRAND_NVIDIA},
    {"l40s", "NVIDIA L40S", NVML_DEVICE_ARCH_ADA, 0, 0, 0, 1, 0, 0, 0, 4, 16, 0x26B910DE, NVML_BRAND_NVIDIA},
    {"t4", "Tesla T4", NVML_DEVICE_ARCH_TURING, 0, 0, 0, 0, 1, 0, 0, 3, 16, 0x1EB810DE, NVML_BRAND_TESLA},
    {"gb200", "NVIDIA GB200", NVML_DEVICE_ARCH_BLACKWELL, 18, 1, 0, 1, 0, 1, 1, 5, 16, 0x294110DE,
     NVML_BRAND_NVIDIA},
};

static const profile_t *find_profile(const char *key)
{
    for (size_t k = 0; k < sizeof PROFILES / sizeof PROFILES[0]; k++) {
        if (strcmp(PROFILES[k].key, key) == 0)
            return &PROFILES[k];
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The node file, parsed: plain values, copied into the live device structs on every good (re)load.
 */
typedef struct {
    char name[64];
    int code;
} fail_t;

typedef struct {
    fail_t fail[MAX_NAMES];
    int nfail;
    char hang[MAX_NAMES][64];
    int nhang;
    char crash[MAX_NAMES][64];
    int ncrash;
} overrides_t;

typedef struct {
    char uuid[96];
    unsigned gi, ci;
    char profile[48];
    unsigned long long memory_mib;
} mig_conf_t;

typedef struct {
    char uuid[96];
    int index;
    unsigned minor;
    int numa; /* -1: none */
    char name[96];
    unsigned long long memory_mib;
    int peers[MAX_LINK_SLOTS];
    int npeers;
    char pcie_switch[64]; /* "": none */
    char bus_id[32];
    unsigned slowdown, shutdown, pcie_max_gen, pcie_max_width;
    const profile_t *profile;
    /* signals */
    int nxid;
    unsigned xids[MAX_LIST];
    int nmig_ev;
    unsigned mig_ev_gi[MAX_LIST], mig_ev_xid[MAX_LIST];
    unsigned long long ecc_unc, ecc_corr;
    int remap_pending, remap_failure, retired_pending;
    unsigned retired_count;
    unsigned temp;
    unsigned long long clock_bits;
    unsigned pcie_gen, pcie_width;
    unsigned replay;
    unsigned long long nvlink_down; /* bit per link */
    unsigned long long nvlink_err, nvlink_crc;
    unsigned recovery;
    unsigned fabric;
    int reset_required, lost, nvml_error;
    int nproc; /* compute_processes */
    unsigned proc_pid[MAX_PROCS];
    unsigned long long proc_mib[MAX_PROCS];
    int proc_has_mib[MAX_PROCS];
    char proc_name[MAX_PROCS][64];
    /* per-GPU "nvml" object */
    overrides_t ov;
    int links_trained; /* -1: all */
    int past_disabled;
    int ecc_on;
    int mig_on;
    int nmig;
    mig_conf_t migs[MAX_MIG];
} gpu_conf_t;

typedef struct {
    char driver[64];
    int driver_major;
    overrides_t ov;
    int ngpus;
    gpu_conf_t gpus[MAX_GPUS];
} node_t;

/* The structs behind nvmlDevice_t: never freed, so a stale handle stays a pointer the library can recognise. */
struct nvmlDevice_st {
    unsigned magic;
    int is_mig;
    int present;
    char uuid[96];
    gpu_conf_t *conf;              /* GPU */
    struct nvmlDevice_st *parent;  /* MIG */
    int slot;                      /* MIG: index in the parent's mig_devices */
};

typedef struct {
    nvmlEventData_t q[QUEUE_LEN];
    int head, len;
} queue_t;

struct nvmlEventSet_st {
    unsigned magic;
    int alive;
    queue_t queue;
    struct {
        struct nvmlDevice_st *dev;
        unsigned long long mask;
    } regs[MAX_SET_REGS];
    int nregs;
};

/* ---------------------------------------------------------------------------------------------------------------
 * Global state, all under g_mu (violations and call counts have their own locks: they are read from anywhere).
 */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_refcount;
static char g_path[PATH_MAX];
static char g_dir[PATH_MAX];
static char g_driver[64] = "570.124.06";
static int g_driver_major = 570;
static overrides_t g_ov;
static struct nvmlDevice_st *g_devs[MAX_REG];
static int g_ndevs;
static struct nvmlDevice_st *g_order[MAX_GPUS]; /* present GPUs by index */
static int g_count;
static struct nvmlEventSet_st *g_sets[MAX_SETS];
static int g_nsets;

typedef struct {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    long long mtime_ns;
} filekey_t;
static filekey_t g_key; /* of the last file read, good or bad */
static int g_ifd = -1;   /* inotify on g_dir, drained at each call */
static char g_base[NAME_MAX + 1];
static unsigned long long g_gen; /* good loads applied */
static int g_bad_reported;

static pthread_mutex_t g_vmu = PTHREAD_MUTEX_INITIALIZER;
static int g_vcount;
static char g_vmsgs[KEEP_VIOLATIONS][256];

static pthread_mutex_t g_cmu = PTHREAD_MUTEX_INITIALIZER;
#define MAX_COUNTERS 256
static struct {
    const char *name;
    unsigned long long n;
} g_counters[MAX_COUNTERS];
static int g_ncounters;

/* ---------------------------------------------------------------------------------------------------------------
 * Violations and call counts.
 */
__attribute__((format(printf, 1, 2))) static void violation(const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&g_vmu);
    snprintf(g_vmsgs[g_vcount % KEEP_VIOLATIONS], sizeof g_vmsgs[0], "%s", msg);
    g_vcount++;
    pthread_mutex_unlock(&g_vmu);
    fprintf(stderr, "nvml-standin: VIOLATION: %s\n", msg);
}

int ghdpStandinViolationCount(void)
{
    pthread_mutex_lock(&g_vmu);
    int n = g_vcount;
    pthread_mutex_unlock(&g_vmu);
    return n;
}

int ghdpStandinViolation(int i, char *buf, unsigned int len)
{
    int rc = -1;
    pthread_mutex_lock(&g_vmu);
    int kept = g_vcount < KEEP_VIOLATIONS ? g_vcount : KEEP_VIOLATIONS;
    if (i >= 0 && i < kept && buf && len > 0) {
        int first = g_vcount - kept;
        snprintf(buf, len, "%s", g_vmsgs[(first + i) % KEEP_VIOLATIONS]);
        rc = 0;
    }
    pthread_mutex_unlock(&g_vmu);
    return rc;
}

void ghdpStandinResetViolations(void)
{
    pthread_mutex_lock(&g_vmu);
    g_vcount = 0;
    pthread_mutex_unlock(&g_vmu);
}

static int counter_slot(const char *name)
{
    pthread_mutex_lock(&g_cmu);
    int slot = -1;
    for (int k = 0; k < g_ncounters; k++) {
        if (strcmp(g_counters[k].name, name) == 0)
            slot = k;
    }
    if (slot < 0 && g_ncounters < MAX_COUNTERS) {
        slot = g_ncounters++;
        g_counters[slot].name = name;
        g_counters[slot].n = 0;
    }
    pthread_mutex_unlock(&g_cmu);
    return slot;
}

static void count_call(int *slot, const char *name)
{
    int s = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = counter_slot(name);
        __atomic_store_n(slot, s, __ATOMIC_RELEASE);
    }
    if (s >= 0)
        __atomic_fetch_add(&g_counters[s].n, 1ull, __ATOMIC_RELAXED);
}

unsigned long long ghdpStandinCallCount(const char *name)
{
    unsigned long long n = 0;
    if (!name)
        return 0;
    pthread_mutex_lock(&g_cmu);
    for (int k = 0; k < g_ncounters; k++) {
        if (strcmp(g_counters[k].name, name) == 0)
            n = __atomic_load_n(&g_counters[k].n, __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&g_cmu);
    return n;
}

void ghdpStandinResetCallCounts(void)
{
    pthread_mutex_lock(&g_cmu);
    for (int k = 0; k < g_ncounters; k++)
        __atomic_store_n(&g_counters[k].n, 0ull, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_cmu);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Memory checks that never dereference: the kernel copies, and answers EFAULT for memory that is not there.
 */
static int readable(const void *p, size_t size)
{
    char buf[4096];
    size_t done = 0;
    while (done < size) {
        size_t chunk = size - done < sizeof buf ? size - done : sizeof buf;
        struct iovec local = {buf, chunk};
        struct iovec remote = {(char *)p + done, chunk};
        ssize_t n = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
        if (n < 0 && (errno == ENOSYS || errno == EPERM)) {
            /* No process_vm_readv (seccomp): a pipe write faults the same way. */
            int fds[2];
            if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0)
                return 1;
            ssize_t w = write(fds[1], (const char *)p + done, chunk);
            close(fds[0]);
            close(fds[1]);
            if (w <= 0)
                return 0;
            n = w;
        }
        if (n <= 0)
            return 0;
        done += (size_t)n;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Node file parsing.
 */
typedef struct {
    char *err;
    size_t errlen;
} perr_t;

__attribute__((format(printf, 2, 3))) static int perr(perr_t *e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->err, e->errlen, fmt, ap);
    va_end(ap);
    return -1;
}

static int get_int(perr_t *e, const jval *v, const char *where, long long min, long long max, long long *out)
{
    if (!v || v->t != J_NUM || !v->is_int)
        return perr(e, "%s: expected an integer", where);
    if (v->i < min || v->i > max)
        return perr(e, "%s: out of range (%lld..%lld), got %lld", where, min, max, v->i);
    *out = v->i;
    return 0;
}

static int opt_uint(perr_t *e, const jval *obj, const char *key, const char *where, unsigned long long dflt,
                    unsigned long long max, unsigned long long *out)
{
    const jval *v = json_get(obj, key);
    char w[160];
    long long x;
    if (!v || v->t == J_NULL) {
        *out = dflt;
        return 0;
    }
    snprintf(w, sizeof w, "%s.%s", where, key);
    if (get_int(e, v, w, 0, (long long)(max > LLONG_MAX ? LLONG_MAX : max), &x))
        return -1;
    *out = (unsigned long long)x;
    return 0;
}

static int opt_bool(perr_t *e, const jval *obj, const char *key, const char *where, int dflt, int *out)
{
    const jval *v = json_get(obj, key);
    if (!v || v->t == J_NULL) {
        *out = dflt;
        return 0;
    }
    if (v->t != J_BOOL)
        return perr(e, "%s.%s: expected true or false", where, key);
    *out = v->b;
    return 0;
}

static int copy_str(perr_t *e, const jval *v, const char *where, char *out, size_t outlen)
{
    if (!v || v->t != J_STR)
        return perr(e, "%s: expected a string", where);
    if (strlen(v->s) >= outlen)
        return perr(e, "%s: longer than %zu characters", where, outlen - 1);
    strcpy(out, v->s);
    return 0;
}

static const struct {
    const char *name;
    int code;
} ERROR_NAMES[] = {
    {"success", NVML_SUCCESS},
    {"uninitialized", NVML_ERROR_UNINITIALIZED},
    {"invalid_argument", NVML_ERROR_INVALID_ARGUMENT},
    {"not_supported", NVML_ERROR_NOT_SUPPORTED},
    {"no_permission", NVML_ERROR_NO_PERMISSION},
    {"already_initialized", NVML_ERROR_ALREADY_INITIALIZED},
    {"not_found", NVML_ERROR_NOT_FOUND},
    {"insufficient_size", NVML_ERROR_INSUFFICIENT_SIZE},
    {"insufficient_power", NVML_ERROR_INSUFFICIENT_POWER},
    {"driver_not_loaded", NVML_ERROR_DRIVER_NOT_LOADED},
    {"timeout", NVML_ERROR_TIMEOUT},
    {"irq_issue", NVML_ERROR_IRQ_ISSUE},
    {"library_not_found", NVML_ERROR_LIBRARY_NOT_FOUND},
    {"function_not_found", NVML_ERROR_FUNCTION_NOT_FOUND},
    {"corrupted_inforom", NVML_ERROR_CORRUPTED_INFOROM},
    {"gpu_is_lost", NVML_ERROR_GPU_IS_LOST},
    {"reset_required", NVML_ERROR_RESET_REQUIRED},
    {"operating_system", NVML_ERROR_OPERATING_SYSTEM},
    {"lib_rm_version_mismatch", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"in_use", NVML_ERROR_IN_USE},
    {"memory", NVML_ERROR_MEMORY},
    {"no_data", NVML_ERROR_NO_DATA},
    {"vgpu_ecc_not_supported", NVML_ERROR_VGPU_ECC_NOT_SUPPORTED},
    {"insufficient_resources", NVML_ERROR_INSUFFICIENT_RESOURCES},
    {"freq_not_supported", NVML_ERROR_FREQ_NOT_SUPPORTED},
    {"argument_version_mismatch", NVML_ERROR_ARGUMENT_VERSION_MISMATCH},
    {"deprecated", NVML_ERROR_DEPRECATED},
    {"not_ready", NVML_ERROR_NOT_READY},
    {"gpu_not_found", NVML_ERROR_GPU_NOT_FOUND},
    {"invalid_state", NVML_ERROR_INVALID_STATE},
    {"unknown", NVML_ERROR_UNKNOWN},
};

static int parse_names(perr_t *e, const jval *v, const char *where, char names[][64], int *n)
{
    *n = 0;
    if (!v)
        return 0;
    if (v->t != J_ARR)
        return perr(e, "%s: expected a list of function names", where);
    if (v->n > MAX_NAMES)
        return perr(e, "%s: at most %d names", where, MAX_NAMES);
    for (int k = 0; k < v->n; k++) {
        char w[160];
        snprintf(w, sizeof w, "%s[%d]", where, k);
        if (copy_str(e, v->items[k], w, names[k], 64))
            return -1;
        (*n)++;
    }
    return 0;
}

static int parse_overrides(perr_t *e, const jval *nv, const char *where, overrides_t *ov)
{
    char w[160];
    memset(ov, 0, sizeof *ov);
    const jval *fail = json_get(nv, "fail");
    if (fail) {
        if (fail->t != J_OBJ)
            return perr(e, "%s.fail: expected an object of function name: error name", where);
        if (fail->n > MAX_NAMES)
            return perr(e, "%s.fail: at most %d functions", where, MAX_NAMES);
        for (int k = 0; k < fail->n; k++) {
            snprintf(w, sizeof w, "%s.fail.%s", where, fail->keys[k]);
            if (strlen(fail->keys[k]) >= sizeof ov->fail[0].name)
                return perr(e, "%s: function name too long", w);
            strcpy(ov->fail[k].name, fail->keys[k]);
            const jval *c = fail->items[k];
            int found = 0;
            if (c->t == J_STR) {
                for (size_t m = 0; m < sizeof ERROR_NAMES / sizeof ERROR_NAMES[0]; m++) {
                    if (strcmp(ERROR_NAMES[m].name, c->s) == 0) {
                        ov->fail[k].code = ERROR_NAMES[m].code;
                        found = 1;
                    }
                }
                if (!found)
                    return perr(e, "%s: unknown NVML error name '%s' (e.g. not_supported, unknown, timeout)", w,
                                c->s);
            } else {
                long long x;
                if (get_int(e, c, w, 0, 100000, &x))
                    return -1;
                ov->fail[k].code = (int)x;
            }
            ov->nfail++;
        }
    }
    snprintf(w, sizeof w, "%s.hang", where);
    if (parse_names(e, json_get(nv, "hang"), w, ov->hang, &ov->nhang))
        return -1;
    snprintf(w, sizeof w, "%s.crash", where);
    if (parse_names(e, json_get(nv, "crash"), w, ov->crash, &ov->ncrash))
        return -1;
    return 0;
}

static const char *RECOVERY_NAMES[] = {"none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"};
static const char *FABRIC_NAMES[] = {"", "healthy", "unhealthy", "limited_capacity"};
static const struct {
    const char *name;
    unsigned long long bit;
} CLOCK_NAMES[] = {
    {"hw_slowdown", 0x8},
    {"sw_thermal_slowdown", 0x20},
    {"hw_thermal_slowdown", 0x40},
    {"hw_power_brake_slowdown", 0x80},
};

static int parse_int_list(perr_t *e, const jval *v, const char *where, unsigned *out, int *n, long long max)
{
    *n = 0;
    if (!v || v->t == J_NULL)
        return 0;
    if (v->t != J_ARR)
        return perr(e, "%s: expected a list of integers", where);
    if (v->n > MAX_LIST)
        return perr(e, "%s: at most %d entries", where, MAX_LIST);
    for (int k = 0; k < v->n; k++) {
        char w[160];
        long long x;
        snprintf(w, sizeof w, "%s[%d]", where, k);
        if (get_int(e, v->items[k], w, 0, max, &x))
            return -1;
        out[k] = (unsigned)x;
        (*n)++;
    }
    return 0;
}

static int parse_signals(perr_t *e, const jval *s, const char *where, gpu_conf_t *g)
{
    char w[200];
    unsigned long long x;
    unsigned tmp[MAX_LIST];
    int n;
    if (!s || s->t != J_OBJ)
        return perr(e, "%s.signals: expected an object", where);
    snprintf(w, sizeof w, "%s.signals", where);
    snprintf(w, sizeof w, "%s.signals.xid_events", where);
    if (parse_int_list(e, json_get(s, "xid_events"), w, g->xids, &g->nxid, UINT_MAX))
        return -1;
    const jval *me = json_get(s, "mig_events");
    if (me && me->t != J_NULL) {
        if (me->t != J_ARR)
            return perr(e, "%s.signals.mig_events: expected a list", where);
        if (me->n > MAX_LIST)
            return perr(e, "%s.signals.mig_events: at most %d entries", where, MAX_LIST);
        for (int k = 0; k < me->n; k++) {
            snprintf(w, sizeof w, "%s.signals.mig_events[%d]", where, k);
            if (me->items[k]->t != J_OBJ)
                return perr(e, "%s: expected an object with gpu_instance_id and xid", w);
            unsigned long long gi, xid;
            if (!json_get(me->items[k], "gpu_instance_id") || !json_get(me->items[k], "xid"))
                return perr(e, "%s: needs gpu_instance_id and xid", w);
            if (opt_uint(e, me->items[k], "gpu_instance_id", w, 0, UINT_MAX, &gi) ||
                opt_uint(e, me->items[k], "xid", w, 0, UINT_MAX, &xid))
                return -1;
            g->mig_ev_gi[k] = (unsigned)gi;
            g->mig_ev_xid[k] = (unsigned)xid;
        }
        g->nmig_ev = me->n;
    }
    const jval *cp = json_get(s, "compute_processes");
    g->nproc = 0;
    if (cp && cp->t != J_NULL) {
        if (cp->t != J_ARR)
            return perr(e, "%s.signals.compute_processes: expected a list", where);
        if (cp->n > MAX_PROCS)
            return perr(e, "%s.signals.compute_processes: at most %d entries", where, MAX_PROCS);
        for (int k = 0; k < cp->n; k++) {
            snprintf(w, sizeof w, "%s.signals.compute_processes[%d]", where, k);
            const jval *p = cp->items[k];
            if (p->t != J_OBJ || !json_get(p, "pid"))
                return perr(e, "%s: expected an object with pid (used_mib, name optional)", w);
            unsigned long long pid, mib;
            if (opt_uint(e, p, "pid", w, 0, UINT_MAX, &pid) || opt_uint(e, p, "used_mib", w, 0, 1ull << 40, &mib))
                return -1;
            const jval *nm = json_get(p, "name");
            if (nm && nm->t != J_STR)
                return perr(e, "%s.name: expected a string", w);
            g->proc_pid[k] = (unsigned)pid;
            g->proc_mib[k] = mib;
            g->proc_has_mib[k] = json_get(p, "used_mib") != NULL;
            snprintf(g->proc_name[k], sizeof g->proc_name[k], "%s", nm ? nm->s : "");
        }
        g->nproc = cp->n;
    }
    snprintf(w, sizeof w, "%s.signals", where);
    if (opt_uint(e, s, "ecc_uncorrected_volatile", w, 0, ULLONG_MAX, &g->ecc_unc) ||
        opt_uint(e, s, "ecc_corrected_volatile", w, 0, ULLONG_MAX, &g->ecc_corr) ||
        opt_bool(e, s, "row_remap_pending", w, 0, &g->remap_pending) ||
        opt_bool(e, s, "row_remap_failure", w, 0, &g->remap_failure) ||
        opt_bool(e, s, "retired_pages_pending", w, 0, &g->retired_pending) ||
        opt_bool(e, s, "reset_required", w, 0, &g->reset_required) ||
        opt_bool(e, s, "lost", w, 0, &g->lost) || opt_bool(e, s, "nvml_error", w, 0, &g->nvml_error) ||
        opt_uint(e, s, "nvlink_error_count", w, 0, ULLONG_MAX, &g->nvlink_err))
        return -1;
    if (opt_uint(e, s, "retired_pages_count", w, 0, 1u << 20, &x))
        return -1;
    g->retired_count = (unsigned)x;
    if (opt_uint(e, s, "temperature_c", w, 40, 1000, &x))
        return -1;
    g->temp = (unsigned)x;
    if (opt_uint(e, s, "pcie_replay_count", w, 0, UINT_MAX, &x))
        return -1;
    g->replay = (unsigned)x;
    const jval *ce = json_get(s, "clock_event_reasons");
    g->clock_bits = 0;
    if (ce && ce->t != J_NULL) {
        if (ce->t != J_ARR)
            return perr(e, "%s.signals.clock_event_reasons: expected a list of names", where);
        for (int k = 0; k < ce->n; k++) {
            int found = 0;
            for (size_t m = 0; m < sizeof CLOCK_NAMES / sizeof CLOCK_NAMES[0]; m++) {
                if (ce->items[k]->t == J_STR && strcmp(ce->items[k]->s, CLOCK_NAMES[m].name) == 0) {
                    g->clock_bits |= CLOCK_NAMES[m].bit;
                    found = 1;
                }
            }
            if (!found)
                return perr(e, "%s.signals.clock_event_reasons[%d]: unknown reason", where, k);
        }
    }
    g->pcie_gen = g->pcie_max_gen;
    g->pcie_width = g->pcie_max_width;
    const jval *pl = json_get(s, "pcie_link");
    if (pl && pl->t != J_NULL) {
        snprintf(w, sizeof w, "%s.signals.pcie_link", where);
        if (pl->t != J_OBJ)
            return perr(e, "%s: expected {\"gen\": int, \"width\": int}", w);
        if (opt_uint(e, pl, "gen", w, g->pcie_max_gen, 64, &x))
            return -1;
        g->pcie_gen = (unsigned)x;
        if (opt_uint(e, pl, "width", w, g->pcie_max_width, 64, &x))
            return -1;
        g->pcie_width = (unsigned)x;
    }
    snprintf(w, sizeof w, "%s.signals.nvlink_down", where);
    if (parse_int_list(e, json_get(s, "nvlink_down"), w, tmp, &n, MAX_LINK_SLOTS - 1))
        return -1;
    g->nvlink_down = 0;
    for (int k = 0; k < n; k++)
        g->nvlink_down |= 1ull << tmp[k];
    const jval *ra = json_get(s, "recovery_action");
    g->recovery = 0;
    if (ra && ra->t != J_NULL) {
        int found = 0;
        for (unsigned m = 0; m < 5; m++) {
            if (ra->t == J_STR && strcmp(ra->s, RECOVERY_NAMES[m]) == 0) {
                g->recovery = m;
                found = 1;
            }
        }
        if (!found)
            return perr(e, "%s.signals.recovery_action: expected one of none, gpu_reset, node_reboot, drain_p2p, "
                        "drain_and_reset", where);
    }
    const jval *fh = json_get(s, "fabric_health");
    g->fabric = 1;
    if (fh && fh->t != J_NULL) {
        int found = 0;
        for (unsigned m = 1; m < 4; m++) {
            if (fh->t == J_STR && strcmp(fh->s, FABRIC_NAMES[m]) == 0) {
                g->fabric = m;
                found = 1;
            }
        }
        if (!found)
            return perr(e, "%s.signals.fabric_health: expected healthy, unhealthy or limited_capacity", where);
    }
    return 0;
}

static int parse_gpu(perr_t *e, const jval *gv, int k, const profile_t *node_profile, gpu_conf_t *g)
{
    char where[160], w[200];
    long long x;
    memset(g, 0, sizeof *g);
    snprintf(where, sizeof where, "gpus[%d]", k);
    if (!gv || gv->t != J_OBJ)
        return perr(e, "%s: expected an object", where);
    snprintf(w, sizeof w, "%s.uuid", where);
    if (copy_str(e, json_get(gv, "uuid"), w, g->uuid, sizeof g->uuid))
        return -1;
    snprintf(where, sizeof where, "gpus[%d] (%s)", k, g->uuid);
    snprintf(w, sizeof w, "%s.index", where);
    if (get_int(e, json_get(gv, "index"), w, 0, 1 << 20, &x))
        return -1;
    g->index = (int)x;
    g->numa = -1;
    const jval *numa = json_get(gv, "numa_node");
    snprintf(w, sizeof w, "%s.numa_node", where);
    if (!numa)
        return perr(e, "%s: required (an integer or null)", w);
    if (numa->t != J_NULL) {
        if (get_int(e, numa, w, 0, 65534, &x))
            return -1;
        g->numa = (int)x;
    }
    snprintf(w, sizeof w, "%s.name", where);
    if (copy_str(e, json_get(gv, "name"), w, g->name, sizeof g->name))
        return -1;
    snprintf(w, sizeof w, "%s.memory_mib", where);
    if (get_int(e, json_get(gv, "memory_mib"), w, 0, 1ll << 40, &x))
        return -1;
    g->memory_mib = (unsigned long long)x;
    const jval *peers = json_get(gv, "nvlink_peers");
    snprintf(w, sizeof w, "%s.nvlink_peers", where);
    if (!peers || peers->t != J_ARR)
        return perr(e, "%s: required, a list of GPU indices", w);
    if (peers->n > MAX_LINK_SLOTS)
        return perr(e, "%s: at most %d peers", w, MAX_LINK_SLOTS);
    for (int p = 0; p < peers->n; p++) {
        char pw[220];
        snprintf(pw, sizeof pw, "%s[%d]", w, p);
        if (get_int(e, peers->items[p], pw, 0, 1 << 20, &x))
            return -1;
        g->peers[p] = (int)x;
    }
    g->npeers = peers->n;
    const jval *sw = json_get(gv, "pcie_switch");
    snprintf(w, sizeof w, "%s.pcie_switch", where);
    if (!sw)
        return perr(e, "%s: required (a string or null)", w);
    if (sw->t != J_NULL && copy_str(e, sw, w, g->pcie_switch, sizeof g->pcie_switch))
        return -1;
    const jval *minor = json_get(gv, "minor");
    g->minor = (unsigned)g->index;
    if (minor && minor->t != J_NULL) {
        snprintf(w, sizeof w, "%s.minor", where);
        if (get_int(e, minor, w, 0, 1 << 20, &x))
            return -1;
        g->minor = (unsigned)x;
    }
    const jval *bus = json_get(gv, "pci_bus_id");
    if (bus && bus->t != J_NULL) {
        snprintf(w, sizeof w, "%s.pci_bus_id", where);
        if (copy_str(e, bus, w, g->bus_id, sizeof g->bus_id))
            return -1;
    } else {
        /* A domain no real node uses, so a made-up id never meets a file's own. */
        snprintf(g->bus_id, sizeof g->bus_id, "%08X:%02X:00.0", 0x100u + ((unsigned)g->index >> 8),
                 (unsigned)g->index & 0xFF);
    }
    g->profile = node_profile;
    const jval *prof = json_get(gv, "profile");
    if (prof && prof->t != J_NULL) {
        snprintf(w, sizeof w, "%s.profile", where);
        if (prof->t != J_STR || !(g->profile = find_profile(prof->s)))
            return perr(e, "%s: expected one of a100-sxm, h100-sxm, h100-pcie, l40s, t4, gb200", w);
    }
    unsigned long long u;
    if (opt_uint(e, gv, "temperature_slowdown_c", where, 87, 1000, &u))
        return -1;
    g->slowdown = (unsigned)u;
    if (opt_uint(e, gv, "temperature_shutdown_c", where, 92, 1000, &u))
        return -1;
    g->shutdown = (unsigned)u;
    if (opt_uint(e, gv, "pcie_max_gen", where, g->profile->gen, 64, &u))
        return -1;
    g->pcie_max_gen = (unsigned)u;
    if (opt_uint(e, gv, "pcie_max_width", where, g->profile->width, 64, &u))
        return -1;
    g->pcie_max_width = (unsigned)u;
    const jval *migs = json_get(gv, "mig_devices");
    if (migs && migs->t != J_NULL) {
        snprintf(w, sizeof w, "%s.mig_devices", where);
        if (migs->t != J_ARR)
            return perr(e, "%s: expected a list", w);
        if (migs->n > MAX_MIG)
            return perr(e, "%s: at most %d MIG devices", w, MAX_MIG);
        for (int m = 0; m < migs->n; m++) {
            char mw[240];
            mig_conf_t *mc = &g->migs[m];
            snprintf(mw, sizeof mw, "%s[%d]", w, m);
            if (migs->items[m]->t != J_OBJ)
                return perr(e, "%s: expected an object", mw);
            char kw[260];
            snprintf(kw, sizeof kw, "%s.uuid", mw);
            if (copy_str(e, json_get(migs->items[m], "uuid"), kw, mc->uuid, sizeof mc->uuid))
                return -1;
            snprintf(kw, sizeof kw, "%s.profile", mw);
            if (copy_str(e, json_get(migs->items[m], "profile"), kw, mc->profile, sizeof mc->profile))
                return -1;
            snprintf(kw, sizeof kw, "%s.gpu_instance_id", mw);
            if (get_int(e, json_get(migs->items[m], "gpu_instance_id"), kw, 0, 1 << 20, &x))
                return -1;
            mc->gi = (unsigned)x;
            if (opt_uint(e, migs->items[m], "compute_instance_id", mw, 0, 1 << 20, &u))
                return -1;
            mc->ci = (unsigned)u;
            if (opt_uint(e, migs->items[m], "memory_mib", mw, 0, 1ull << 40, &mc->memory_mib))
                return -1;
        }
        g->nmig = migs->n;
    }
    if (parse_signals(e, json_get(gv, "signals"), where, g))
        return -1;
    const jval *nv = json_get(gv, "nvml");
    g->links_trained = -1;
    g->ecc_on = 1;
    g->mig_on = g->nmig > 0;
    if (nv && nv->t != J_NULL) {
        snprintf(w, sizeof w, "%s.nvml", where);
        if (nv->t != J_OBJ)
            return perr(e, "%s: expected an object", w);
        if (parse_overrides(e, nv, w, &g->ov))
            return -1;
        const jval *lt = json_get(nv, "links_trained");
        if (lt && lt->t != J_NULL) {
            char lw[220];
            snprintf(lw, sizeof lw, "%s.links_trained", w);
            if (get_int(e, lt, lw, 0, MAX_LINK_SLOTS, &x))
                return -1;
            g->links_trained = (int)x;
        }
        const jval *pl = json_get(nv, "past_links");
        if (pl && pl->t != J_NULL) {
            if (pl->t != J_STR || (strcmp(pl->s, "invalid_argument") != 0 && strcmp(pl->s, "disabled") != 0))
                return perr(e, "%s.past_links: expected \"invalid_argument\" or \"disabled\"", w);
            g->past_disabled = strcmp(pl->s, "disabled") == 0;
        }
        if (opt_bool(e, nv, "ecc", w, 1, &g->ecc_on) || opt_bool(e, nv, "mig", w, g->nmig > 0, &g->mig_on) ||
            opt_uint(e, nv, "nvlink_crc", w, 0, ULLONG_MAX, &g->nvlink_crc))
            return -1;
        const jval *raw = json_get(nv, "recovery_action_raw");
        if (raw && raw->t != J_NULL) {
            char rw[220];
            snprintf(rw, sizeof rw, "%s.recovery_action_raw", w);
            if (get_int(e, raw, rw, 0, UINT_MAX, &x))
                return -1;
            g->recovery = (unsigned)x;
        }
    }
    return 0;
}

static int parse_node(const jval *root, node_t *n, perr_t *e)
{
    memset(n, 0, sizeof *n);
    if (!root || root->t != J_OBJ)
        return perr(e, "the document must be an object with a \"gpus\" list");
    strcpy(n->driver, "570.124.06");
    const profile_t *profile = find_profile("h100-sxm");
    const jval *nv = json_get(root, "nvml");
    if (nv && nv->t != J_NULL) {
        if (nv->t != J_OBJ)
            return perr(e, "nvml: expected an object");
        const jval *dv = json_get(nv, "driver_version");
        if (dv && copy_str(e, dv, "nvml.driver_version", n->driver, sizeof n->driver))
            return -1;
        const jval *pv = json_get(nv, "profile");
        if (pv && (pv->t != J_STR || !(profile = find_profile(pv->s))))
            return perr(e, "nvml.profile: expected one of a100-sxm, h100-sxm, h100-pcie, l40s, t4, gb200");
        if (parse_overrides(e, nv, "nvml", &n->ov))
            return -1;
    }
    n->driver_major = atoi(n->driver);
    const jval *gpus = json_get(root, "gpus");
    if (!gpus || gpus->t != J_ARR)
        return perr(e, "gpus: required, a list");
    if (gpus->n > MAX_GPUS)
        return perr(e, "gpus: at most %d GPUs", MAX_GPUS);
    for (int k = 0; k < gpus->n; k++) {
        if (parse_gpu(e, gpus->items[k], k, profile, &n->gpus[k]))
            return -1;
        for (int j = 0; j < k; j++) {
            if (strcmp(n->gpus[j].uuid, n->gpus[k].uuid) == 0)
                return perr(e, "gpus[%d].uuid: duplicate of gpus[%d]", k, j);
            if (n->gpus[j].index == n->gpus[k].index)
                return perr(e, "gpus[%d].index: duplicate of gpus[%d]", k, j);
        }
        n->ngpus++;
    }
    return 0;
}

static int read_node(const char *path, node_t *n, char *err, size_t errlen, filekey_t *key)
{
    perr_t e = {err, errlen};
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return perr(&e, "cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return perr(&e, "cannot stat: %s", strerror(errno));
    }
    if (key) {
        key->valid = 1;
        key->dev = st.st_dev;
        key->ino = st.st_ino;
        key->size = st.st_size;
        key->mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec;
    }
    size_t cap = (size_t)st.st_size + 1, len = 0;
    char *buf = malloc(cap);
    if (!buf) {
        close(fd);
        return perr(&e, "out of memory");
    }
    while (1) {
        if (len == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                close(fd);
                return perr(&e, "out of memory");
            }
            buf = nb;
            cap *= 2;
        }
        ssize_t r = read(fd, buf + len, cap - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            free(buf);
            close(fd);
            return perr(&e, "cannot read: %s", strerror(errno));
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    char jerr[200];
    jval *root = json_parse(buf, len, jerr, sizeof jerr);
    free(buf);
    if (!root)
        return perr(&e, "%s", jerr);
    int rc = parse_node(root, n, &e);
    json_free(root);
    return rc;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Applying a load: handles are found by UUID so they survive rewrites; changes become events.
 */
static struct nvmlDevice_st *find_dev(const char *uuid, int is_mig)
{
    for (int k = 0; k < g_ndevs; k++) {
        if (g_devs[k]->is_mig == is_mig && strcmp(g_devs[k]->uuid, uuid) == 0)
            return g_devs[k];
    }
    return NULL;
}

static struct nvmlDevice_st *new_dev(const char *uuid, int is_mig)
{
    if (g_ndevs >= MAX_REG)
        return NULL;
    struct nvmlDevice_st *d = calloc(1, sizeof *d);
    if (!d)
        return NULL;
    if (!is_mig && !(d->conf = calloc(1, sizeof *d->conf))) {
        free(d);
        return NULL;
    }
    d->magic = DEVICE_MAGIC;
    d->is_mig = is_mig;
    snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
    g_devs[g_ndevs++] = d;
    return d;
}

static void emit(struct nvmlDevice_st *d, unsigned long long type, unsigned long long data, unsigned gi, unsigned ci)
{
    for (int s = 0; s < g_nsets; s++) {
        struct nvmlEventSet_st *set = g_sets[s];
        if (!set->alive)
            continue;
        for (int r = 0; r < set->nregs; r++) {
            if (set->regs[r].dev != d || !(set->regs[r].mask & type))
                continue;
            queue_t *q = &set->queue;
            if (q->len == QUEUE_LEN) { /* full: the oldest goes, as a driver's ring would overwrite */
                q->head = (q->head + 1) % QUEUE_LEN;
                q->len--;
            }
            nvmlEventData_t *ev = &q->q[(q->head + q->len) % QUEUE_LEN];
            memset(ev, 0, sizeof *ev);
            ev->device.handle = d;
            ev->eventType = type;
            ev->eventData = data;
            ev->gpuInstanceId = gi;
            ev->computeInstanceId = ci;
            q->len++;
            break;
        }
    }
}

static void diff_events(struct nvmlDevice_st *d, const gpu_conf_t *old, const gpu_conf_t *now)
{
    for (int k = old->nxid; k < now->nxid; k++)
        emit(d, EV_XID, now->xids[k], WHOLE, WHOLE);
    for (int k = old->nmig_ev; k < now->nmig_ev; k++)
        emit(d, EV_XID, now->mig_ev_xid[k], now->mig_ev_gi[k], 0);
    if (now->ecc_unc > old->ecc_unc)
        emit(d, EV_DBE, 0, WHOLE, WHOLE);
    if (now->lost && !old->lost)
        emit(d, EV_UNAVAILABLE, 0, WHOLE, WHOLE);
    if (now->recovery != old->recovery)
        emit(d, EV_RECOVERY, now->recovery, WHOLE, WHOLE);
}

/* fresh: the first load of an init from zero, where every list is history. */
static int apply(const node_t *n, int fresh, char *err, size_t errlen)
{
    /* Allocate first, so a registry that is full leaves the old state whole. */
    for (int k = 0; k < n->ngpus; k++) {
        if (!find_dev(n->gpus[k].uuid, 0) && !new_dev(n->gpus[k].uuid, 0))
            return snprintf(err, errlen, "too many distinct GPUs over this process's life"), -1;
        for (int m = 0; m < n->gpus[k].nmig; m++) {
            if (!find_dev(n->gpus[k].migs[m].uuid, 1) && !new_dev(n->gpus[k].migs[m].uuid, 1))
                return snprintf(err, errlen, "too many distinct MIG devices over this process's life"), -1;
        }
    }
    for (int k = 0; k < g_ndevs; k++) {
        if (fresh)
            g_devs[k]->present = 0;
        g_devs[k]->present = g_devs[k]->present ? 2 : 0; /* 2: was present, not yet seen in this load */
    }
    for (int k = 0; k < n->ngpus; k++) {
        const gpu_conf_t *c = &n->gpus[k];
        struct nvmlDevice_st *d = find_dev(c->uuid, 0);
        if (d->present == 2)
            diff_events(d, d->conf, c);
        memcpy(d->conf, c, sizeof *c);
        d->present = 1;
        for (int m = 0; m < c->nmig; m++) {
            struct nvmlDevice_st *md = find_dev(c->migs[m].uuid, 1);
            md->parent = d;
            md->slot = m;
            md->present = 1;
        }
    }
    for (int k = 0; k < g_ndevs; k++) {
        if (g_devs[k]->present == 2)
            g_devs[k]->present = 0;
    }
    g_count = 0;
    for (int k = 0; k < n->ngpus; k++) {
        struct nvmlDevice_st *d = find_dev(n->gpus[k].uuid, 0);
        int at = g_count++;
        while (at > 0 && g_order[at - 1]->conf->index > d->conf->index) {
            g_order[at] = g_order[at - 1];
            at--;
        }
        g_order[at] = d;
    }
    snprintf(g_driver, sizeof g_driver, "%s", n->driver);
    g_driver_major = n->driver_major;
    g_ov = n->ov;
    g_gen++;
    return 0;
}

static int key_now(filekey_t *k)
{
    struct stat st;
    memset(k, 0, sizeof *k);
    if (stat(g_path, &st) != 0)
        return -1;
    k->valid = 1;
    k->dev = st.st_dev;
    k->ino = st.st_ino;
    k->size = st.st_size;
    k->mtime_ns = (long long)st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec;
    return 0;
}

static int same_key(const filekey_t *a, const filekey_t *b)
{
    return a->valid == b->valid && a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
           a->mtime_ns == b->mtime_ns;
}

/* Whether the persistent watch saw our file touched. stat() alone misses a same-size rewrite within one
 * timestamp tick whose atomic rename reused the inode number; the watch does not. */
static int drain_watch(void)
{
    if (g_ifd < 0)
        return 0;
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    int hit = 0;
    ssize_t n;
    while ((n = read(g_ifd, buf, sizeof buf)) > 0) {
        for (char *q = buf; q < buf + n;) {
            struct inotify_event *ev = (struct inotify_event *)q;
            if ((ev->mask & IN_Q_OVERFLOW) || (ev->len && strcmp(ev->name, g_base) == 0))
                hit = 1;
            q += sizeof *ev + ev->len;
        }
    }
    return hit;
}

/* Under g_mu: re-read the file when it changed; a bad rewrite keeps the last good state. */
static void maybe_reload(void)
{
    filekey_t k;
    int hit = drain_watch();
    if (key_now(&k) != 0 || (!hit && same_key(&k, &g_key)))
        return; /* a file being replaced may be missing for a moment: keep what we have */
    node_t *n = malloc(sizeof *n);
    if (!n)
        return;
    char err[300];
    filekey_t read_key;
    memset(&read_key, 0, sizeof read_key);
    int rc = read_node(g_path, n, err, sizeof err, &read_key);
    g_key = read_key.valid ? read_key : k;
    if (rc == 0)
        rc = apply(n, 0, err, sizeof err);
    if (rc != 0) {
        if (!g_bad_reported)
            fprintf(stderr, "nvml-standin: %s: %s; keeping the last good state\n", g_path, err);
        g_bad_reported = 1;
    } else {
        g_bad_reported = 0;
    }
    free(n);
}

/* Called and returning with g_mu held, which it releases while blocked: waits until something in the node file's
 * directory changes, or timeout_ms (-1: no limit). The watch is set before the last look at the file, so a change
 * can never fall between that look and the wait. */
static void wait_change(int timeout_ms)
{
    unsigned long long gen = g_gen;
    int fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (fd >= 0 && inotify_add_watch(fd, g_dir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE |
                                                    IN_DELETE | IN_MODIFY | IN_ATTRIB | IN_DELETE_SELF) < 0) {
        close(fd);
        fd = -1;
    }
    maybe_reload();
    if (g_gen != gen) {
        if (fd >= 0)
            close(fd);
        return;
    }
    pthread_mutex_unlock(&g_mu);
    if (fd < 0) {
        /* No inotify (limits reached): a slow re-check is the best left. */
        struct timespec ts = {0, 100 * 1000 * 1000};
        if (timeout_ms >= 0 && timeout_ms < 100)
            ts.tv_nsec = (long)timeout_ms * 1000 * 1000;
        nanosleep(&ts, NULL);
    } else {
        struct pollfd p = {fd, POLLIN, 0};
        while (poll(&p, 1, timeout_ms) < 0 && errno == EINTR) {
        }
        close(fd);
    }
    pthread_mutex_lock(&g_mu);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---------------------------------------------------------------------------------------------------------------
 * The common prologue of every call.
 */
static void base_name(const char *fn, char *out, size_t outlen)
{
    snprintf(out, outlen, "%s", fn);
    size_t n = strlen(out);
    size_t k = n;
    while (k > 0 && out[k - 1] >= '0' && out[k - 1] <= '9')
        k--;
    if (k < n && k >= 2 && out[k - 1] == 'v' && out[k - 2] == '_')
        out[k - 2] = '\0';
}

static int in_names(char names[][64], int n, const char *base)
{
    for (int k = 0; k < n; k++) {
        if (strcmp(names[k], base) == 0)
            return 1;
    }
    return 0;
}

static int fail_code(const overrides_t *ov, const char *base)
{
    for (int k = 0; k < ov->nfail; k++) {
        if (strcmp(ov->fail[k].name, base) == 0)
            return ov->fail[k].code;
    }
    return -1;
}

/* Under g_mu, after init and reload: crash, hang and forced failures of this call, file-wide or for the GPU. */
static nvmlReturn_t overrides(const char *fn, struct nvmlDevice_st *gpu)
{
    char base[96];
    base_name(fn, base, sizeof base);
    while (1) {
        gpu_conf_t *c = gpu && gpu->present ? gpu->conf : NULL;
        if (in_names(g_ov.crash, g_ov.ncrash, base) || (c && in_names(c->ov.crash, c->ov.ncrash, base))) {
            fprintf(stderr, "nvml-standin: %s: crashing as the node file asks\n", fn);
            fflush(stderr);
            pthread_mutex_unlock(&g_mu);
            raise(SIGSEGV);
            pthread_mutex_lock(&g_mu); /* a handler that returns: carry on */
        }
        if (!(in_names(g_ov.hang, g_ov.nhang, base) || (c && in_names(c->ov.hang, c->ov.nhang, base))))
            break;
        wait_change(-1);
        if (g_refcount == 0)
            return NVML_ERROR_UNINITIALIZED;
        maybe_reload();
    }
    int code = fail_code(&g_ov, base);
    if (code < 0 && gpu && gpu->present)
        code = fail_code(&gpu->conf->ov, base);
    return code < 0 ? NVML_SUCCESS : (nvmlReturn_t)code;
}

static nvmlReturn_t enter(int *slot, const char *fn)
{
    count_call(slot, fn);
    pthread_mutex_lock(&g_mu);
    if (g_refcount == 0) {
        pthread_mutex_unlock(&g_mu);
        return NVML_ERROR_UNINITIALIZED;
    }
    maybe_reload();
    return NVML_SUCCESS;
}

static int is_ours(const struct nvmlDevice_st *p)
{
    for (int k = 0; k < g_ndevs; k++) {
        if (g_devs[k] == p)
            return 1;
    }
    return 0;
}

static nvmlReturn_t check_device(const char *fn, const char *arg, struct nvmlDevice_st *p)
{
    if (!p)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!is_ours(p)) {
        violation("%s: %s: %p is not a device handle this library returned", fn, arg, (void *)p);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t check_ptr(const char *fn, const char *arg, const void *p, size_t size)
{
    if (!p) {
        /* The real library answers INVALID_ARGUMENT; no correct caller passes NULL for a required argument, and a
         * struct passed by value where a pointer belongs can arrive as NULL, so it is recorded too. */
        violation("%s: %s: NULL", fn, arg);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (!readable(p, size)) {
        violation("%s: %s: %p is not valid memory for %zu bytes", fn, arg, p, size);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

static struct nvmlDevice_st *gpu_of(struct nvmlDevice_st *d)
{
    return d->is_mig ? d->parent : d;
}

/* The GPU's own condition: removed, lost, needing a reset, failing, or MIG where the call takes no MIG handle. */
static nvmlReturn_t check_state(const char *fn, struct nvmlDevice_st *d, int allow_mig)
{
    struct nvmlDevice_st *g = gpu_of(d);
    nvmlReturn_t r = overrides(fn, g);
    if (r != NVML_SUCCESS)
        return r;
    if (!g || !g->present || !d->present)
        return NVML_ERROR_GPU_IS_LOST;
    if (g->conf->lost)
        return NVML_ERROR_GPU_IS_LOST;
    if (g->conf->reset_required)
        return NVML_ERROR_RESET_REQUIRED;
    if (g->conf->nvml_error)
        return NVML_ERROR_UNKNOWN;
    if (d->is_mig && !allow_mig)
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

static nvmlReturn_t put_str(const char *s, char *out, unsigned int len)
{
    if (strlen(s) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

/* Function skeleton: ENTER counts, locks and checks init; the other macros jump to LEAVE with an error code. */
#define ENTER(name)                                                                                              \
    static int cslot_ = -1;                                                                                      \
    const char *fn_ = name;                                                                                      \
    struct nvmlDevice_st *dev_ = NULL;                                                                           \
    gpu_conf_t *g = NULL;                                                                                        \
    nvmlReturn_t ret = enter(&cslot_, fn_);                                                                      \
    if (ret != NVML_SUCCESS)                                                                                     \
        return ret;                                                                                              \
    (void)dev_;                                                                                                  \
    (void)g
#define TRY(expr)                                                                                                \
    do {                                                                                                         \
        ret = (expr);                                                                                            \
        if (ret != NVML_SUCCESS)                                                                                 \
            goto out;                                                                                            \
    } while (0)
#define DEVICE(h) TRY(check_device(fn_, #h, (dev_ = (h).handle)))
#define PTR(p) TRY(check_ptr(fn_, #p, (p), sizeof *(p)))
#define STATE(allow_mig)                                                                                         \
    do {                                                                                                         \
        TRY(check_state(fn_, dev_, allow_mig));                                                                  \
        g = gpu_of(dev_)->conf;                                                                                  \
    } while (0)
#define SYSTEM() TRY(overrides(fn_, NULL))
#define RETURN(code)                                                                                             \
    do {                                                                                                         \
        ret = (code);                                                                                            \
        goto out;                                                                                                \
    } while (0)
/* An enum argument out of nvml.h's range: the real library answers INVALID_ARGUMENT, but no caller of ours means to
 * pass one, and a pointer landing in an enum's slot is what a missing or misplaced argument looks like. */
#define ENUM_IN_RANGE(ok, arg)                                                                                   \
    do {                                                                                                         \
        if (!(ok)) {                                                                                             \
            violation("%s: %s: %#llx is not a value nvml.h defines (an argument missing or out of place?)", fn_, \
                      #arg, (unsigned long long)(arg));                                                          \
            RETURN(NVML_ERROR_INVALID_ARGUMENT);                                                                 \
        }                                                                                                        \
    } while (0)
#define LEAVE                                                                                                    \
    out:                                                                                                         \
    pthread_mutex_unlock(&g_mu);                                                                                 \
    return ret

static const mig_conf_t *mig_conf(struct nvmlDevice_st *d)
{
    return &d->parent->conf->migs[d->slot];
}

static struct nvmlDevice_st *gpu_by_file_index(int index)
{
    for (int k = 0; k < g_count; k++) {
        if (g_order[k]->conf->index == index)
            return g_order[k];
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Init and shutdown: ref-counted like the real library; each init re-reads the node file.
 */
static nvmlReturn_t do_init(const char *fn)
{
    pthread_mutex_lock(&g_mu);
    const char *path = getenv(ENV_NODE);
    if (!path || !*path) {
        fprintf(stderr, "nvml-standin: %s is not set: no node file to stand in for the driver\n", ENV_NODE);
        pthread_mutex_unlock(&g_mu);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    node_t *n = malloc(sizeof *n);
    char err[300];
    filekey_t key;
    memset(&key, 0, sizeof key);
    if (!n || read_node(path, n, err, sizeof err, &key) != 0) {
        fprintf(stderr, "nvml-standin: %s=%s: %s\n", ENV_NODE, path, n ? err : "out of memory");
        free(n);
        pthread_mutex_unlock(&g_mu);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    char full[PATH_MAX];
    if (!realpath(path, full))
        snprintf(full, sizeof full, "%s", path);
    int same_file = strcmp(full, g_path) == 0;
    if (!same_file || g_ifd < 0) {
        snprintf(g_path, sizeof g_path, "%s", full);
        const char *slash = strrchr(g_path, '/');
        if (slash) {
            snprintf(g_dir, sizeof g_dir, "%.*s", (int)(slash - g_path) > 0 ? (int)(slash - g_path) : 1, g_path);
            snprintf(g_base, sizeof g_base, "%.*s", NAME_MAX, slash + 1);
        } else {
            snprintf(g_dir, sizeof g_dir, ".");
            snprintf(g_base, sizeof g_base, "%.*s", NAME_MAX, g_path);
        }
        if (g_ifd >= 0)
            close(g_ifd);
        g_ifd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
        if (g_ifd >= 0 &&
            inotify_add_watch(g_ifd, g_dir, IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_MODIFY | IN_ATTRIB) < 0) {
            close(g_ifd);
            g_ifd = -1;
        }
    }
    drain_watch();
    if (apply(n, g_refcount == 0 || !same_file, err, sizeof err) != 0) {
        fprintf(stderr, "nvml-standin: %s=%s: %s\n", ENV_NODE, path, err);
        free(n);
        pthread_mutex_unlock(&g_mu);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    free(n);
    g_key = key;
    g_bad_reported = 0;
    char base[96];
    base_name(fn, base, sizeof base);
    int code = fail_code(&g_ov, base);
    if (code > 0) {
        pthread_mutex_unlock(&g_mu);
        return (nvmlReturn_t)code;
    }
    g_refcount++;
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void)
{
    static int slot = -1;
    count_call(&slot, "nvmlInit_v2");
    return do_init("nvmlInit_v2");
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    static int slot = -1;
    (void)flags;
    count_call(&slot, "nvmlInitWithFlags");
    return do_init("nvmlInitWithFlags");
}

nvmlReturn_t nvmlShutdown(void)
{
    static int slot = -1;
    count_call(&slot, "nvmlShutdown");
    pthread_mutex_lock(&g_mu);
    if (g_refcount == 0) {
        pthread_mutex_unlock(&g_mu);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (--g_refcount == 0) {
        /* The real library invalidates every event set at the last shutdown. */
        for (int s = 0; s < g_nsets; s++)
            g_sets[s]->alive = 0;
    }
    pthread_mutex_unlock(&g_mu);
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    static int slot = -1;
    count_call(&slot, "nvmlErrorString");
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    default: return "Unknown Error";
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * System and discovery.
 */
nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    ENTER("nvmlSystemGetDriverVersion");
    TRY(check_ptr(fn_, "version", version, length ? length : 1));
    SYSTEM();
    ret = put_str(g_driver, version, length);
    LEAVE;
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    ENTER("nvmlSystemGetNVMLVersion");
    TRY(check_ptr(fn_, "version", version, length ? length : 1));
    SYSTEM();
    char v[96];
    snprintf(v, sizeof v, "%d.%s", g_driver_major >= 580 ? 13 : 12, g_driver);
    ret = put_str(v, version, length);
    LEAVE;
}

static int cuda_version(void)
{
    return g_driver_major >= 580 ? 13000 : g_driver_major >= 570 ? 12080 : g_driver_major >= 550 ? 12040 : 12020;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    ENTER("nvmlSystemGetCudaDriverVersion");
    PTR(cudaDriverVersion);
    SYSTEM();
    *cudaDriverVersion = cuda_version();
    LEAVE;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    ENTER("nvmlSystemGetCudaDriverVersion_v2");
    PTR(cudaDriverVersion);
    SYSTEM();
    *cudaDriverVersion = cuda_version();
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    ENTER("nvmlDeviceGetCount_v2");
    PTR(deviceCount);
    SYSTEM();
    *deviceCount = (unsigned)g_count;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByIndex_v2");
    PTR(device);
    SYSTEM();
    if (index >= (unsigned)g_count)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    device->handle = g_order[index];
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetHandleByUUID");
    TRY(check_ptr(fn_, "uuid", uuid, 1));
    PTR(device);
    SYSTEM();
    ret = NVML_ERROR_NOT_FOUND;
    for (int k = 0; k < g_ndevs; k++) {
        struct nvmlDevice_st *d = g_devs[k];
        if (d->present && strcmp(d->uuid, uuid) == 0) {
            device->handle = d;
            ret = NVML_SUCCESS;
        }
    }
    LEAVE;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Identity.
 */
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    ENTER("nvmlDeviceGetUUID");
    DEVICE(device);
    TRY(check_ptr(fn_, "uuid", uuid, length ? length : 1));
    STATE(1);
    ret = put_str(dev_->uuid, uuid, length);
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    ENTER("nvmlDeviceGetName");
    DEVICE(device);
    TRY(check_ptr(fn_, "name", name, length ? length : 1));
    STATE(1);
    if (dev_->is_mig) {
        char mn[160];
        snprintf(mn, sizeof mn, "%s MIG %s", g->name, mig_conf(dev_)->profile);
        ret = put_str(mn, name, length);
    } else {
        ret = put_str(g->name, name, length);
    }
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    ENTER("nvmlDeviceGetSerial");
    DEVICE(device);
    TRY(check_ptr(fn_, "serial", serial, length ? length : 1));
    STATE(0);
    char s[32];
    unsigned h = 2166136261u;
    for (const char *c = g->uuid; *c; c++)
        h = (h ^ (unsigned char)*c) * 16777619u;
    snprintf(s, sizeof s, "1654%09u", h % 1000000000u);
    ret = put_str(s, serial, length);
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    ENTER("nvmlDeviceGetMinorNumber");
    DEVICE(device);
    PTR(minorNumber);
    STATE(0);
    *minorNumber = g->minor;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    ENTER("nvmlDeviceGetIndex");
    DEVICE(device);
    PTR(index);
    STATE(0);
    for (int k = 0; k < g_count; k++) {
        if (g_order[k] == dev_)
            *index = (unsigned)k;
    }
    LEAVE;
}

static void fill_pci(const char *bus_id, unsigned device_id, nvmlPciInfo_t *pci)
{
    unsigned dom = 0, bus = 0, dev = 0, fn = 0;
    memset(pci, 0, sizeof *pci);
    sscanf(bus_id, "%x:%x:%x.%x", &dom, &bus, &dev, &fn);
    snprintf(pci->busId, sizeof pci->busId, "%s", bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", dom & 0xFFFF, bus & 0xFF, dev & 0xFF,
             fn & 0xF);
    pci->domain = dom;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = device_id;
    pci->pciSubSystemId = 0x16C110DE;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    ENTER("nvmlDeviceGetPciInfo_v3");
    DEVICE(device);
    PTR(pci);
    STATE(0);
    fill_pci(g->bus_id, g->profile->pci_device_id, pci);
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t device, unsigned int *node)
{
    ENTER("nvmlDeviceGetNumaNodeId");
    DEVICE(device);
    PTR(node);
    STATE(0);
    if (g->numa < 0)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    *node = (unsigned)g->numa;
    LEAVE;
}

static unsigned long long mem_bytes(struct nvmlDevice_st *d, gpu_conf_t *g)
{
    return (d->is_mig ? mig_conf(d)->memory_mib : g->memory_mib) * 1024ull * 1024ull;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    ENTER("nvmlDeviceGetMemoryInfo");
    DEVICE(device);
    PTR(memory);
    STATE(1);
    memory->total = mem_bytes(dev_, g);
    memory->free = memory->total;
    memory->used = 0;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    ENTER("nvmlDeviceGetMemoryInfo_v2");
    DEVICE(device);
    PTR(memory);
    if (memory->version != nvmlMemory_v2) {
        violation("%s: memory: version 0x%x, expected nvmlMemory_v2 (0x%x)", fn_, memory->version, nvmlMemory_v2);
        RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    STATE(1);
    memory->total = mem_bytes(dev_, g);
    memory->reserved = 0;
    memory->free = memory->total;
    memory->used = 0;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, nvmlDeviceArchitecture_t *arch)
{
    ENTER("nvmlDeviceGetArchitecture");
    DEVICE(device);
    PTR(arch);
    STATE(0);
    *arch = g->profile->arch;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, nvmlBrandType_t *type)
{
    ENTER("nvmlDeviceGetBrand");
    DEVICE(device);
    PTR(type);
    STATE(0);
    *type = (nvmlBrandType_t)g->profile->brand;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    ENTER("nvmlDeviceGetPersistenceMode");
    DEVICE(device);
    PTR(mode);
    STATE(0);
    *mode = NVML_FEATURE_ENABLED;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    ENTER("nvmlDeviceGetComputeRunningProcesses_v3");
    DEVICE(device);
    PTR(infoCount);
    if (*infoCount > 0 && infos)
        TRY(check_ptr(fn_, "infos", infos, sizeof *infos * *infoCount));
    STATE(1);
    if (dev_->is_mig) {
        *infoCount = 0; /* the stand-in's processes run on whole GPUs */
        RETURN(NVML_SUCCESS);
    }
    if (*infoCount < (unsigned)g->nproc || (g->nproc > 0 && !infos)) {
        /* As the driver: the count needed, and INSUFFICIENT_SIZE; pynvml then asks again with room. */
        *infoCount = (unsigned)g->nproc;
        RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (int k = 0; k < g->nproc; k++) {
        memset(&infos[k], 0, sizeof infos[k]);
        infos[k].pid = g->proc_pid[k];
        infos[k].usedGpuMemory = g->proc_has_mib[k] ? g->proc_mib[k] << 20 : NVML_VALUE_NOT_AVAILABLE;
        infos[k].gpuInstanceId = WHOLE;
        infos[k].computeInstanceId = WHOLE;
    }
    *infoCount = (unsigned)g->nproc;
    LEAVE;
}

nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name, unsigned int length)
{
    ENTER("nvmlSystemGetProcessName");
    TRY(check_ptr(fn_, "name", name, length ? length : 1));
    SYSTEM();
    ret = NVML_ERROR_NOT_FOUND;
    for (int d = 0; d < g_ndevs && ret == NVML_ERROR_NOT_FOUND; d++) {
        gpu_conf_t *c = g_devs[d]->is_mig || !g_devs[d]->present ? NULL : g_devs[d]->conf;
        for (int k = 0; c && k < c->nproc; k++) {
            if (c->proc_pid[k] == pid && c->proc_name[k][0]) {
                ret = put_str(c->proc_name[k], name, length);
                break;
            }
        }
    }
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                 nvmlGpuTopologyLevel_t *pathInfo)
{
    ENTER("nvmlDeviceGetTopologyCommonAncestor");
    DEVICE(device2);
    struct nvmlDevice_st *other = dev_;
    DEVICE(device1);
    PTR(pathInfo);
    STATE(0);
    TRY(check_state(fn_, other, 0));
    gpu_conf_t *h = other->conf;
    if (dev_ == other)
        *pathInfo = NVML_TOPOLOGY_INTERNAL;
    else if (g->pcie_switch[0] && strcmp(g->pcie_switch, h->pcie_switch) == 0)
        *pathInfo = NVML_TOPOLOGY_MULTIPLE;
    else if (g->numa >= 0 && g->numa == h->numa)
        *pathInfo = NVML_TOPOLOGY_NODE;
    else
        *pathInfo = NVML_TOPOLOGY_SYSTEM;
    LEAVE;
}

/* ---------------------------------------------------------------------------------------------------------------
 * MIG.
 */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    ENTER("nvmlDeviceGetMigMode");
    DEVICE(device);
    PTR(currentMode);
    PTR(pendingMode);
    STATE(0);
    if (!g->profile->mig)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = *pendingMode = g->mig_on ? NVML_DEVICE_MIG_ENABLE : NVML_DEVICE_MIG_DISABLE;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    ENTER("nvmlDeviceGetMaxMigDeviceCount");
    DEVICE(device);
    PTR(count);
    STATE(0);
    if (!g->profile->mig)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    *count = MAX_MIG;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice)
{
    ENTER("nvmlDeviceGetMigDeviceHandleByIndex");
    DEVICE(device);
    PTR(migDevice);
    STATE(0);
    if (!g->profile->mig)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    if (index >= MAX_MIG)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->mig_on || index >= (unsigned)g->nmig)
        RETURN(NVML_ERROR_NOT_FOUND);
    migDevice->handle = find_dev(g->migs[index].uuid, 1);
    LEAVE;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    ENTER("nvmlDeviceIsMigDeviceHandle");
    DEVICE(device);
    PTR(isMigDevice);
    STATE(1);
    *isMigDevice = (unsigned)dev_->is_mig;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    ENTER("nvmlDeviceGetGpuInstanceId");
    DEVICE(device);
    PTR(id);
    STATE(1);
    if (!dev_->is_mig)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *id = mig_conf(dev_)->gi;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    ENTER("nvmlDeviceGetComputeInstanceId");
    DEVICE(device);
    PTR(id);
    STATE(1);
    if (!dev_->is_mig)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *id = mig_conf(dev_)->ci;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    ENTER("nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
    DEVICE(migDevice);
    PTR(device);
    STATE(1);
    if (!dev_->is_mig)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    device->handle = dev_->parent;
    LEAVE;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Health signals.
 */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType, unsigned long long *eccCounts)
{
    ENTER("nvmlDeviceGetTotalEccErrors");
    DEVICE(device);
    PTR(eccCounts);
    STATE(0);
    ENUM_IN_RANGE((unsigned)errorType <= NVML_MEMORY_ERROR_TYPE_UNCORRECTED, errorType);
    ENUM_IN_RANGE((unsigned)counterType <= NVML_AGGREGATE_ECC, counterType);
    if (!g->ecc_on)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    *eccCounts = errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED ? g->ecc_unc : g->ecc_corr;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current, nvmlEnableState_t *pending)
{
    ENTER("nvmlDeviceGetEccMode");
    DEVICE(device);
    PTR(current);
    PTR(pending);
    STATE(0);
    *current = *pending = g->ecc_on ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    ENTER("nvmlDeviceGetRemappedRows");
    DEVICE(device);
    PTR(corrRows);
    PTR(uncRows);
    PTR(isPending);
    PTR(failureOccurred);
    STATE(0);
    if (!g->profile->remap)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    *corrRows = 0;
    *uncRows = g->remap_pending || g->remap_failure ? 1 : 0;
    *isPending = (unsigned)g->remap_pending;
    *failureOccurred = (unsigned)g->remap_failure;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, nvmlEnableState_t *isPending)
{
    ENTER("nvmlDeviceGetRetiredPagesPendingStatus");
    DEVICE(device);
    PTR(isPending);
    STATE(0);
    if (!g->profile->retired)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    *isPending = g->retired_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, nvmlPageRetirementCause_t cause, unsigned int *pageCount,
                                       unsigned long long *addresses)
{
    ENTER("nvmlDeviceGetRetiredPages");
    DEVICE(device);
    PTR(pageCount);
    STATE(0);
    if (!g->profile->retired)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    ENUM_IN_RANGE((unsigned)cause < NVML_PAGE_RETIREMENT_CAUSE_COUNT, cause);
    /* All retired pages are double-bit ones: the count is what the policy reads, the cause split is not. */
    unsigned n = cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR ? g->retired_count : 0;
    if (n == 0) {
        *pageCount = 0;
        RETURN(NVML_SUCCESS);
    }
    if (!addresses || *pageCount < n) {
        *pageCount = n;
        RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    TRY(check_ptr(fn_, "addresses", addresses, sizeof *addresses * n));
    for (unsigned k = 0; k < n; k++)
        addresses[k] = 0x100000ull * (k + 1);
    *pageCount = n;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType, unsigned int *temp)
{
    ENTER("nvmlDeviceGetTemperature");
    DEVICE(device);
    PTR(temp);
    STATE(0);
    ENUM_IN_RANGE((unsigned)sensorType < NVML_TEMPERATURE_COUNT, sensorType);
    if (sensorType != NVML_TEMPERATURE_GPU)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *temp = g->temp;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, nvmlTemperatureThresholds_t thresholdType,
                                               unsigned int *temp)
{
    ENTER("nvmlDeviceGetTemperatureThreshold");
    DEVICE(device);
    PTR(temp);
    STATE(0);
    ENUM_IN_RANGE((unsigned)thresholdType < NVML_TEMPERATURE_THRESHOLD_COUNT, thresholdType);
    if (thresholdType == NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
        *temp = g->shutdown;
    else if (thresholdType == NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        *temp = g->slowdown;
    else
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    LEAVE;
}

static unsigned long long clock_reasons(const gpu_conf_t *g)
{
    return g->clock_bits ? g->clock_bits : 0x1ull;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *clocksEventReasons)
{
    ENTER("nvmlDeviceGetCurrentClocksEventReasons");
    DEVICE(device);
    PTR(clocksEventReasons);
    STATE(0);
    *clocksEventReasons = clock_reasons(g);
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *clocksThrottleReasons)
{
    ENTER("nvmlDeviceGetCurrentClocksThrottleReasons");
    DEVICE(device);
    PTR(clocksThrottleReasons);
    STATE(0);
    *clocksThrottleReasons = clock_reasons(g);
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *currLinkGen)
{
    ENTER("nvmlDeviceGetCurrPcieLinkGeneration");
    DEVICE(device);
    PTR(currLinkGen);
    STATE(0);
    *currLinkGen = g->pcie_gen;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *currLinkWidth)
{
    ENTER("nvmlDeviceGetCurrPcieLinkWidth");
    DEVICE(device);
    PTR(currLinkWidth);
    STATE(0);
    *currLinkWidth = g->pcie_width;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGen)
{
    ENTER("nvmlDeviceGetMaxPcieLinkGeneration");
    DEVICE(device);
    PTR(maxLinkGen);
    STATE(0);
    *maxLinkGen = g->pcie_max_gen;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *maxLinkWidth)
{
    ENTER("nvmlDeviceGetMaxPcieLinkWidth");
    DEVICE(device);
    PTR(maxLinkWidth);
    STATE(0);
    *maxLinkWidth = g->pcie_max_width;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value)
{
    ENTER("nvmlDeviceGetPcieReplayCounter");
    DEVICE(device);
    PTR(value);
    STATE(0);
    *value = g->replay;
    LEAVE;
}

/* ---------------------------------------------------------------------------------------------------------------
 * NVLink: link k < len(nvlink_peers) goes to the k-th peer; the rest of an NVSwitch profile's links to switches.
 */
typedef struct {
    int active;
    int trained;                 /* the link came up at some point (has a far end) */
    struct nvmlDevice_st *peer;  /* far-end GPU */
    int nvswitch;
} link_t;

static nvmlReturn_t link_of(const gpu_conf_t *g, unsigned link, link_t *out)
{
    const profile_t *p = g->profile;
    memset(out, 0, sizeof *out);
    if (p->links == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= MAX_LINK_SLOTS)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= p->links)
        return g->past_disabled ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (p->nobridge || (g->links_trained >= 0 && link >= (unsigned)g->links_trained))
        return NVML_SUCCESS;
    if (link < (unsigned)g->npeers)
        out->peer = gpu_by_file_index(g->peers[link]);
    else
        out->nvswitch = p->nvswitch;
    out->trained = out->peer || out->nvswitch;
    out->active = out->trained && !(g->nvlink_down & (1ull << link));
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    ENTER("nvmlDeviceGetNvLinkState");
    DEVICE(device);
    PTR(isActive);
    STATE(0);
    link_t l;
    TRY(link_of(g, link, &l));
    *isActive = l.active ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    ENTER("nvmlDeviceGetNvLinkRemotePciInfo_v2");
    DEVICE(device);
    PTR(pci);
    STATE(0);
    link_t l;
    TRY(link_of(g, link, &l));
    if (!l.trained)
        RETURN(NVML_ERROR_NOT_FOUND);
    if (l.peer) {
        fill_pci(l.peer->conf->bus_id, l.peer->conf->profile->pci_device_id, pci);
    } else {
        char bus[32];
        snprintf(bus, sizeof bus, "00000010:%02X:00.0", 0x80 + link % 4); /* four NVSwitches, no GPU's domain */
        fill_pci(bus, 0x22A310DE, pci);
    }
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link, nvmlNvLinkErrorCounter_t counter,
                                             unsigned long long *counterValue)
{
    ENTER("nvmlDeviceGetNvLinkErrorCounter");
    DEVICE(device);
    PTR(counterValue);
    STATE(0);
    link_t l;
    TRY(link_of(g, link, &l));
    ENUM_IN_RANGE((unsigned)counter < NVML_NVLINK_ERROR_COUNT, counter);
    *counterValue = 0;
    if (link == 0 && counter == NVML_NVLINK_ERROR_DL_REPLAY)
        *counterValue = g->nvlink_err;
    if (link == 0 && counter == NVML_NVLINK_ERROR_DL_CRC_FLIT)
        *counterValue = g->nvlink_crc;
    LEAVE;
}

static void field_value(const gpu_conf_t *g, nvmlFieldValue_t *v, long long ts)
{
    v->timestamp = ts;
    v->latencyUsec = 0;
    v->nvmlReturn = NVML_SUCCESS;
    v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
    memset(&v->value, 0, sizeof v->value);
    unsigned links = g->profile->links;
    switch (v->fieldId) {
    case NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
        if (g_driver_major < 570) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            return;
        }
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        v->value.uiVal = g->recovery;
        return;
    case NVML_FI_DEV_NVLINK_GET_STATE: {
        link_t l;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        if (links == 0)
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else if (v->scopeId >= links)
            v->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT;
        else if (link_of(g, v->scopeId, &l) == NVML_SUCCESS)
            v->value.uiVal = l.active ? 1 : 0;
        return;
    }
    case NVML_FI_DEV_NVLINK_LINK_COUNT:
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        if (links == 0)
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        v->value.uiVal = links;
        return;
    case NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL:
    case NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL:
    case NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL:
    case NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL:
        if (links == 0) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            return;
        }
        if (v->fieldId == NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL)
            v->value.ullVal = g->nvlink_err;
        else if (v->fieldId == NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL)
            v->value.ullVal = g->nvlink_crc;
        return;
    default:
        v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
    }
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values)
{
    ENTER("nvmlDeviceGetFieldValues");
    DEVICE(device);
    if (valuesCount < 0)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    TRY(check_ptr(fn_, "values", values, sizeof *values * (size_t)(valuesCount ? valuesCount : 1)));
    STATE(0);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long us = (long long)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    for (int k = 0; k < valuesCount; k++)
        field_value(g, &values[k], us);
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *gpuFabricInfo)
{
    ENTER("nvmlDeviceGetGpuFabricInfoV");
    DEVICE(device);
    /* Only the version word is known to be there until the version says how big the struct is. */
    TRY(check_ptr(fn_, "gpuFabricInfo", gpuFabricInfo, sizeof(unsigned int)));
    unsigned version = gpuFabricInfo->version;
    if (version != nvmlGpuFabricInfo_v3 && version != nvmlGpuFabricInfo_v2) {
        violation("%s: gpuFabricInfo: version 0x%x, expected nvmlGpuFabricInfo_v3 (0x%x) or _v2 (0x%x); "
                  "was the struct passed by value?",
                  fn_, version, nvmlGpuFabricInfo_v3, nvmlGpuFabricInfo_v2);
        RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    }
    TRY(check_ptr(fn_, "gpuFabricInfo", gpuFabricInfo, version & 0xFFFFFF));
    STATE(0);
    if (!g->profile->fabric)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    if (version == nvmlGpuFabricInfo_v2) {
        nvmlGpuFabricInfo_v2_t *v2 = (nvmlGpuFabricInfo_v2_t *)gpuFabricInfo;
        memset((char *)v2 + sizeof v2->version, 0, sizeof *v2 - sizeof v2->version);
        v2->state = NVML_GPU_FABRIC_STATE_COMPLETED;
        v2->status = NVML_SUCCESS;
        v2->cliqueId = 1;
    } else {
        memset((char *)gpuFabricInfo + sizeof version, 0, sizeof *gpuFabricInfo - sizeof version);
        gpuFabricInfo->state = NVML_GPU_FABRIC_STATE_COMPLETED;
        gpuFabricInfo->status = NVML_SUCCESS;
        gpuFabricInfo->cliqueId = 1;
        gpuFabricInfo->healthSummary = (unsigned char)g->fabric;
    }
    for (int k = 0; k < NVML_GPU_FABRIC_UUID_LEN; k++)
        gpuFabricInfo->clusterUuid[k] = (unsigned char)(0x5a + k);
    LEAVE;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Events.
 */
static nvmlReturn_t check_set(const char *fn, struct nvmlEventSet_st *s)
{
    if (!s)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int k = 0; k < g_nsets; k++) {
        if (g_sets[k] == s) {
            if (s->alive)
                return NVML_SUCCESS;
            violation("%s: set: %p was freed (or invalidated by the last nvmlShutdown)", fn, (void *)s);
            return NVML_ERROR_INVALID_ARGUMENT;
        }
    }
    violation("%s: set: %p is not an event set this library created", fn, (void *)s);
    return NVML_ERROR_INVALID_ARGUMENT;
}

static unsigned long long supported_events(void)
{
    return EV_SBE | EV_DBE | EV_XID | (g_driver_major >= 570 ? EV_UNAVAILABLE | EV_RECOVERY : 0);
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    ENTER("nvmlEventSetCreate");
    PTR(set);
    SYSTEM();
    struct nvmlEventSet_st *s = NULL;
    if (g_nsets < MAX_SETS) {
        s = calloc(1, sizeof *s);
        if (!s)
            RETURN(NVML_ERROR_MEMORY);
        g_sets[g_nsets++] = s;
    } else {
        /* Sets are kept after free so a stale one is recognised; at the cap, reuse a dead one. */
        for (int k = 0; k < g_nsets && !s; k++) {
            if (!g_sets[k]->alive)
                s = g_sets[k];
        }
        if (!s)
            RETURN(NVML_ERROR_INSUFFICIENT_RESOURCES);
        memset(s, 0, sizeof *s);
    }
    s->magic = SET_MAGIC;
    s->alive = 1;
    set->handle = s;
    LEAVE;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    ENTER("nvmlEventSetFree");
    TRY(check_set(fn_, set.handle));
    SYSTEM();
    set.handle->alive = 0;
    set.handle->nregs = 0;
    set.handle->queue.len = 0;
    LEAVE;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    ENTER("nvmlDeviceGetSupportedEventTypes");
    DEVICE(device);
    PTR(eventTypes);
    STATE(0);
    *eventTypes = supported_events();
    LEAVE;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    ENTER("nvmlDeviceRegisterEvents");
    DEVICE(device);
    TRY(check_set(fn_, set.handle));
    STATE(1);
    if (dev_->is_mig || (eventTypes & ~supported_events()))
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    struct nvmlEventSet_st *s = set.handle;
    for (int r = 0; r < s->nregs; r++) {
        if (s->regs[r].dev == dev_) {
            s->regs[r].mask |= eventTypes;
            RETURN(NVML_SUCCESS);
        }
    }
    if (s->nregs >= MAX_SET_REGS)
        RETURN(NVML_ERROR_INSUFFICIENT_RESOURCES);
    s->regs[s->nregs].dev = dev_;
    s->regs[s->nregs].mask = eventTypes;
    s->nregs++;
    LEAVE;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    ENTER("nvmlEventSetWait_v2");
    struct nvmlEventSet_st *s = set.handle;
    TRY(check_set(fn_, s));
    PTR(data);
    SYSTEM();
    long long deadline = now_ms() + timeoutms;
    while (1) {
        if (!s->alive)
            RETURN(NVML_ERROR_UNINITIALIZED); /* freed, or shut down, while this thread waited */
        if (s->queue.len > 0) {
            *data = s->queue.q[s->queue.head];
            s->queue.head = (s->queue.head + 1) % QUEUE_LEN;
            s->queue.len--;
            RETURN(NVML_SUCCESS);
        }
        long long left = deadline - now_ms();
        if (left <= 0)
            RETURN(NVML_ERROR_TIMEOUT);
        wait_change(left > INT_MAX ? INT_MAX : (int)left);
        if (g_refcount == 0)
            RETURN(NVML_ERROR_UNINITIALIZED);
        maybe_reload();
    }
    LEAVE;
}
