/*
 * A stand-in libnvidia-ml.so.1 for tests on machines without a GPU.
 *
 * It exports the NVML functions that NVIDIA's pynvml bindings look up for the
 * power-limit calls trainmedic makes, and keeps its state in a text file named by
 * the NVML_STUB_STATE environment variable, re-read on every call so a test can
 * change it while the agent runs:
 *
 *   gpu <index> <uuid> <name> <min_mw> <max_mw> <default_mw> <current_mw>
 *   fail <op> <code>
 *
 * <op> is one of init, count, handle, name, uuid, limit, constraints, default,
 * set, any; <code> an nvmlReturn_t (4 = NO_PERMISSION, 3 = NOT_SUPPORTED).
 * NVML_STUB_FAIL="op=code,op=code" does the same from the environment.
 * Like the real library it answers UNINITIALIZED before nvmlInit, INVALID_ARGUMENT
 * for a GPU index out of range or a limit outside the constraints, NOT_FOUND for
 * an unknown UUID. nvmlDeviceSetPowerManagementLimit writes the file back.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 16
#define MAX_FAILS 16

typedef int nvmlReturn_t;

struct gpu {
    unsigned index;
    char uuid[96];
    char name[64];
    unsigned min_mw, max_mw, default_mw, current_mw;
};

struct fail {
    char op[32];
    int code;
};

/* A handle is a pointer into this table; its slot number is the GPU index. */
struct nvmlDevice_st {
    unsigned index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

static struct nvmlDevice_st handles[MAX_GPUS];
static struct gpu gpus[MAX_GPUS];
static int ngpus;
static struct fail fails[MAX_FAILS];
static int nfails;
static int initialized;

static const char *state_path(void) {
    const char *p = getenv("NVML_STUB_STATE");
    return (p && *p) ? p : NULL;
}

static void add_fail(const char *op, int code) {
    if (nfails < MAX_FAILS) {
        snprintf(fails[nfails].op, sizeof fails[nfails].op, "%s", op);
        fails[nfails].code = code;
        nfails++;
    }
}

static int load(void) {
    ngpus = 0;
    nfails = 0;
    const char *env = getenv("NVML_STUB_FAIL");
    if (env && *env) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", env);
        for (char *item = strtok(buf, ","); item; item = strtok(NULL, ",")) {
            char *eq = strchr(item, '=');
            if (eq) {
                *eq = '\0';
                add_fail(item, atoi(eq + 1));
            }
        }
    }
    const char *path = state_path();
    if (!path)
        return 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        struct gpu g;
        char op[32];
        int code;
        if (ngpus < MAX_GPUS &&
            sscanf(line, "gpu %u %95s %63s %u %u %u %u", &g.index, g.uuid, g.name, &g.min_mw, &g.max_mw,
                   &g.default_mw, &g.current_mw) == 7) {
            gpus[ngpus++] = g;
        } else if (sscanf(line, "fail %31s %d", op, &code) == 2) {
            add_fail(op, code);
        }
    }
    fclose(f);
    return 0;
}

static int save(void) {
    const char *path = state_path();
    if (!path)
        return -1;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -1;
    for (int i = 0; i < ngpus; i++)
        fprintf(f, "gpu %u %s %s %u %u %u %u\n", gpus[i].index, gpus[i].uuid, gpus[i].name, gpus[i].min_mw,
                gpus[i].max_mw, gpus[i].default_mw, gpus[i].current_mw);
    for (int i = 0; i < nfails; i++)
        fprintf(f, "fail %s %d\n", fails[i].op, fails[i].code);
    if (fclose(f) != 0)
        return -1;
    return rename(tmp, path);
}

/* Re-read the state and say whether `op` is told to fail. */
static nvmlReturn_t begin(const char *op, int needs_init) {
    if (load() != 0)
        return NVML_ERROR_UNKNOWN;
    if (needs_init && !initialized)
        return NVML_ERROR_UNINITIALIZED;
    for (int i = 0; i < nfails; i++)
        if (strcmp(fails[i].op, op) == 0 || strcmp(fails[i].op, "any") == 0)
            return fails[i].code;
    return NVML_SUCCESS;
}

static struct gpu *gpu_of(nvmlDevice_t device) {
    if (device < handles || device >= handles + MAX_GPUS)
        return NULL;
    for (int i = 0; i < ngpus; i++)
        if (gpus[i].index == device->index)
            return &gpus[i];
    return NULL;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    nvmlReturn_t ret = begin("init", 0);
    if (ret == NVML_SUCCESS)
        initialized++;
    return ret;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialized)
        return NVML_ERROR_UNINITIALIZED;
    initialized--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t ret = begin("driver", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    if (length < 16)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    snprintf(version, length, "%s", "999.99-stub");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t ret = begin("count", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned)ngpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t ret = begin("handle", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!device || index >= MAX_GPUS)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < ngpus; i++) {
        if (gpus[i].index == index) {
            handles[index].index = index;
            *device = &handles[index];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t ret = begin("handle", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < ngpus; i++) {
        if (strcmp(gpus[i].uuid, uuid) == 0 && gpus[i].index < MAX_GPUS) {
            handles[gpus[i].index].index = gpus[i].index;
            *device = &handles[gpus[i].index];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

static nvmlReturn_t copy_string(const char *op, nvmlDevice_t device, int uuid, char *out, unsigned int length) {
    nvmlReturn_t ret = begin(op, 1);
    if (ret != NVML_SUCCESS)
        return ret;
    struct gpu *g = gpu_of(device);
    if (!g || !out)
        return NVML_ERROR_INVALID_ARGUMENT;
    const char *s = uuid ? g->uuid : g->name;
    if (strlen(s) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    /* Names are stored with '_' for spaces so the state file stays one token per field. */
    snprintf(out, length, "%s", s);
    if (!uuid)
        for (char *c = out; *c; c++)
            if (*c == '_')
                *c = ' ';
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    return copy_string("name", device, 0, name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    return copy_string("uuid", device, 1, uuid, length);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    nvmlReturn_t ret = begin("index", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    struct gpu *g = gpu_of(device);
    if (!g || !index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = g->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device, unsigned int *limit) {
    nvmlReturn_t ret = begin("limit", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    struct gpu *g = gpu_of(device);
    if (!g || !limit)
        return NVML_ERROR_INVALID_ARGUMENT;
    *limit = g->current_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    return nvmlDeviceGetPowerManagementLimit(device, limit);
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *min_limit,
                                                          unsigned int *max_limit) {
    nvmlReturn_t ret = begin("constraints", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    struct gpu *g = gpu_of(device);
    if (!g || !min_limit || !max_limit)
        return NVML_ERROR_INVALID_ARGUMENT;
    *min_limit = g->min_mw;
    *max_limit = g->max_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t device, unsigned int *limit) {
    nvmlReturn_t ret = begin("default", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    struct gpu *g = gpu_of(device);
    if (!g || !limit)
        return NVML_ERROR_INVALID_ARGUMENT;
    *limit = g->default_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t device, unsigned int limit) {
    nvmlReturn_t ret = begin("set", 1);
    if (ret != NVML_SUCCESS)
        return ret;
    struct gpu *g = gpu_of(device);
    if (!g)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (limit < g->min_mw || limit > g->max_mw)
        return NVML_ERROR_INVALID_ARGUMENT;
    g->current_mw = limit;
    return save() == 0 ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}
