/* The cache state and the evaluation of one lookup, compiled: the per-block work of the
 * streaming reconstructor (`analysis.state.CacheState.apply` and `analysis.evaluate.evaluate`).
 *
 * Why: a lookup or a commit run touches tens of blocks, and in Python each block costs a dict
 * get, a Struct and a few attribute reads; live verdicts paid ~17 us of it per event. Here a
 * block is one probe of an open-addressing table and a few loads from a flat array.
 *
 * The rules are exactly the Python ones (the tests feed the same streams through both and
 * compare every row); `analysis.native_state` wraps this module so the reconstructor cannot
 * tell them apart. Strings never cross: the wrapper interns instances, (instance, group)
 * tables, tenants, adapters and identities to small ints, and formats a gap's detail text
 * from the codes returned here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define NTIERS 5 /* Tier: NONE, DEVICE, HOST, DISK, REMOTE (the wrapper's order) */
#define T_NONE 0
#define T_DEVICE 1
#define EMPTY UINT32_MAX

/* GapReason, in the order of the wrapper's _GAPS. */
enum { G_NONE, G_MISSING_BLOCK, G_WINDOW, G_NO_CHECKPOINT, G_MISSING_TAIL, G_INDEXER, G_NOT_RESIDENT,
       G_LEASE, G_IDENTITY, G_TENANT, G_MISALIGNED, G_UNCOMMITTED, G_INVALIDATED, G_CHECKSUM,
       G_CHANGED, G_ROLLBACK };
/* How a group's blocks cover a boundary (GroupSpec.needed); C_INDEXER is C_PREFIX whose epoch
 * mismatch is its own reason. */
enum { C_PREFIX, C_SLIDING, C_MAMBA, C_TAIL, C_INDEXER };
/* Object event kinds, as the wrapper's _KINDS codes them. */
enum { K_CREATE, K_COMMIT, K_OFFLOAD, K_LOAD, K_INVALIDATE, K_EVICT };
/* What a gap's detail text is made of (the wrapper writes it). */
enum { D_NONE, D_REASON, D_NO_COMMIT, D_TENANT, D_IDENTITY, D_TIER, D_BEYOND, D_MISALIGNED };
/* CopyStatus */
enum { S_INVALIDATED = 1, S_UNCOMMITTED, S_CORRUPT, S_OK };

static const int TIER_RANK[NTIERS] = {4, 0, 1, 2, 3};

/* The columns of load_columns, in its order, and each one's item size. */
enum { COL_KIND, COL_TABLE, COL_INST, COL_TIER, COL_REASON, COL_IDENTITY, COL_TENANT, COL_KEY, COL_OFFSETS,
       COL_VALUES, COL_NBYTES, COL_CHECKSUM, COL_LEASE, NCOLS };
static const Py_ssize_t COL_SIZE[NCOLS] = {1, 4, 4, 1, 1, 4, 4, 8, 4, 8, 8, 8, 8};

typedef struct {
    uint64_t nbytes, checksum;
    int64_t ord : 63; /* the stream position of the write (ords start at 1) */
    uint64_t committed : 1;
} Copy; /* 24 bytes, not 32: an object holds one per tier, and millions of objects are common */

/* What every event reads (the key, its tiers' mask) shares the first cache line; each tier's
 * copy is read only by the events of that tier. 192 bytes, a whole number of lines: the array is
 * line-aligned, so an object spans three lines, never four. */
typedef struct {
    uint64_t key;
    uint32_t table, identity, tenant, adapter;
    uint8_t mask, has_commit, inv_reason;
    int64_t lease, inv_ord;
    uint64_t commit_checksum, commit_nbytes;
    Copy copies[NTIERS];
    uint8_t pad_[8];
} Obj;
_Static_assert(sizeof(Obj) == 192 && offsetof(Obj, copies) == 64, "Obj is three cache lines, the first its own");

typedef struct {
    uint64_t key;
    uint32_t table, idx; /* idx EMPTY: a free slot */
} Entry;

typedef struct {
    int64_t ord;
    uint32_t tenant, adapter;
    uint8_t tier, reason;
} Scope;

typedef struct {
    Scope *s;
    uint32_t n, cap;
} Scopes;

typedef struct {
    uint32_t f[6]; /* model, model_revision, adapter, transform, kv_dtype, layout */
    uint64_t epoch;
} Ident;

typedef struct {
    uint8_t present, usable, resident, reason, dkind, rtier;
    uint32_t darg, darg2;
    uint64_t rbytes;
} Check;

typedef struct {
    PyObject_HEAD
    Entry *tab;
    size_t tcap, tcount;
    Obj *objs;       /* line-aligned, inside objs_mem (realloc'd: a large array grows by remapping, not copying) */
    char *objs_mem;
    uint32_t nobj, objcap;
    uint32_t *freel;
    uint32_t nfree, freecap;
    Scopes *bulk;
    uint32_t nbulk;
    Ident *idents;
    uint32_t nident;
    uint32_t *shared;
    uint32_t nshared;
    uint8_t rollback;
    /* the wrapper's maps (State_bind): enum codes, interning tables, and CacheState's per-instance books */
    PyObject *kinds, *tiers, *reasons, *strings, *string_list, *tables, *table_list, *instances, *instance_list,
        *identities, *identity_list, *changes, *leased, *tenants;
    /* With the fleet view (track): the keys each apply gave birth to and forgot, for its index. */
    PyObject *born, *died;
    /* The columns of the batch apply_rows reads (load_columns): buffers held until the next load. */
    Py_buffer cb[NCOLS];
    int ncb;
    Py_ssize_t crows;
    PyObject *cinst, *ctenant; /* the batch's instance and tenant strings, by the columns' indices */
    int64_t *ccount;           /* object events per instance of the batch, not yet added to `changes` */
    long *ctenant_id;          /* the tenants' string ids, -1 until used */
    /* evaluate's scratch, kept between calls */
    Check *checks;
    int32_t *sums;
    size_t scap;
    uint64_t *keys;
    size_t kcap;
    /* The batch's lookups and adopts that apply_rows judges itself (load_requests), held with the columns. */
    Py_buffer rb[16];
    int nrb;
    struct GSpec_ *rspec; /* per recipe, 64 groups */
    Py_ssize_t *rng;      /* per recipe, its groups */
    int64_t *rstep;       /* per recipe, its alignment */
    Py_ssize_t nrecipes, rwidth;
} State;

static inline uint64_t mix(uint64_t key, uint32_t table) {
    uint64_t h = key ^ ((uint64_t)table * 0x9E3779B97F4A7C15ULL);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static int grow_table(State *s) {
    size_t ncap = s->tcap ? s->tcap * 2 : 1024;
    Entry *nt = PyMem_RawMalloc(ncap * sizeof(Entry));
    if (!nt) return -1;
    for (size_t i = 0; i < ncap; i++) nt[i].idx = EMPTY;
    for (size_t i = 0; i < s->tcap; i++) {
        Entry e = s->tab[i];
        if (e.idx == EMPTY) continue;
        size_t j = mix(e.key, e.table) & (ncap - 1);
        while (nt[j].idx != EMPTY) j = (j + 1) & (ncap - 1);
        nt[j] = e;
    }
    PyMem_RawFree(s->tab);
    s->tab = nt;
    s->tcap = ncap;
    return 0;
}

/* The slot holding (table, key), or the free slot where it would go. */
static inline size_t probe(const State *s, uint32_t table, uint64_t key) {
    size_t m = s->tcap - 1, j = mix(key, table) & m;
    while (s->tab[j].idx != EMPTY && (s->tab[j].key != key || s->tab[j].table != table)) j = (j + 1) & m;
    return j;
}

static inline Obj *find(const State *s, uint32_t table, uint64_t key) {
    if (!s->tcap) return NULL;
    size_t j = probe(s, table, key);
    return s->tab[j].idx == EMPTY ? NULL : &s->objs[s->tab[j].idx];
}

/* A new, empty object for (table, key), which must not exist. */
static Obj *born(State *s, uint32_t table, uint64_t key) {
    if ((s->tcount + 1) * 2 > s->tcap && grow_table(s) < 0) return NULL;
    uint32_t idx;
    if (s->nfree) {
        idx = s->freel[--s->nfree];
    } else {
        if (s->nobj == s->objcap) {
            uint32_t ncap = s->objcap ? s->objcap * 2 : 1024;
            char *mem = PyMem_RawRealloc(s->objs_mem, (size_t)ncap * sizeof(Obj) + 64);
            if (!mem) return NULL;
            size_t was = s->objs_mem ? (size_t)((char *)s->objs - s->objs_mem) : 0;
            size_t at = (64 - (uintptr_t)mem % 64) % 64;
            if (s->nobj && at != was) memmove(mem + at, mem + was, (size_t)s->nobj * sizeof(Obj));
            s->objs_mem = mem;
            s->objs = (Obj *)(mem + at);
            s->objcap = ncap;
        }
        idx = s->nobj++;
    }
    size_t j = probe(s, table, key);
    s->tab[j].key = key;
    s->tab[j].table = table;
    s->tab[j].idx = idx;
    s->tcount++;
    Obj *o = &s->objs[idx];
    /* The first line alone: a tier's copy is read only while its bit of `mask` is set, and is
     * written whole when the bit is, so the other two lines are never read stale (nor fetched). */
    memset(o, 0, offsetof(Obj, copies));
    o->key = key;
    o->table = table;
    return o;
}

/* Forget (table, key): backward-shift deletion keeps every probe chain unbroken. */
static int forget(State *s, uint32_t table, uint64_t key) {
    size_t m = s->tcap - 1, i = probe(s, table, key);
    if (s->tab[i].idx == EMPTY) return 0;
    if (s->nfree == s->freecap) {
        uint32_t ncap = s->freecap ? s->freecap * 2 : 1024;
        uint32_t *nf = PyMem_RawRealloc(s->freel, (size_t)ncap * sizeof(uint32_t));
        if (!nf) return -1;
        s->freel = nf;
        s->freecap = ncap;
    }
    s->freel[s->nfree++] = s->tab[i].idx;
    size_t j = i;
    for (;;) {
        j = (j + 1) & m;
        if (s->tab[j].idx == EMPTY) break;
        size_t home = mix(s->tab[j].key, s->tab[j].table) & m;
        /* move j back to i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            s->tab[i] = s->tab[j];
            i = j;
        }
    }
    s->tab[i].idx = EMPTY;
    s->tcount--;
    return 0;
}

static int ensure_scratch(State *s, size_t blocks, size_t groups) {
    size_t need = blocks + groups + 8;
    if (need <= s->scap) return 0;
    size_t ncap = need * 2;
    Check *nc = PyMem_RawRealloc(s->checks, ncap * sizeof(Check));
    if (!nc) return -1;
    s->checks = nc;
    int32_t *ns = PyMem_RawRealloc(s->sums, ncap * 3 * sizeof(int32_t));
    if (!ns) return -1;
    s->sums = ns;
    s->scap = ncap;
    return 0;
}

/* -- argument helpers ------------------------------------------------------------------------ */

static inline int u64(PyObject *o, uint64_t *out) {
    *out = PyLong_AsUnsignedLongLongMask(o);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static inline int i64(PyObject *o, int64_t *out) {
    *out = PyLong_AsLongLong(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

#define NEED(n, name)                                                                    \
    if (nargs != (n)) {                                                                  \
        PyErr_Format(PyExc_TypeError, name "() takes %d arguments (%zd given)", (n), nargs); \
        return NULL;                                                                     \
    }

/* Runs of keys are random probes of a table and an object array larger than the caches. Each
 * key's slot is fetched AHEAD keys before it is read, and its object (the lines the event
 * touches) AHEAD_OBJ keys before, found from that slot by then: the misses of a run overlap
 * instead of following each other. Sampled on the collector benchmark's stream, the object's
 * line was ~60 % of an eviction's time before it was fetched ahead. */
#define AHEAD 32
#define AHEAD_OBJ 12
static inline void ahead(const State *s, uint32_t table, uint64_t key) {
    if (s->tcap) __builtin_prefetch(&s->tab[mix(key, table) & (s->tcap - 1)]);
}

/* `also`: a second line of the object to fetch (an offset into it; 0: its first alone). */
static inline void ahead_obj(const State *s, uint32_t table, uint64_t key, size_t also) {
    if (!s->tcap) return;
    size_t m = s->tcap - 1, j = mix(key, table) & m;
    while (s->tab[j].idx != EMPTY && (s->tab[j].key != key || s->tab[j].table != table)) j = (j + 1) & m;
    if (s->tab[j].idx == EMPTY) return;
    const char *o = (const char *)&s->objs[s->tab[j].idx];
    __builtin_prefetch(o);
    if (also) __builtin_prefetch(o + also);
}

/* The object the free list will hand out at `at`, for writing. */
static inline void ahead_free(const State *s, uint32_t at, size_t also) {
    const char *o = (const char *)&s->objs[s->freel[at]];
    __builtin_prefetch(o, 1);
    __builtin_prefetch(o + also, 1);
}

/* The keys of a fact: its block_key, then its run's more keys: `more` (a list or tuple, or None)
 * or, from columns, `arr[0:narr]`; `body` runs for each with `key` set, the lines at `also` of
 * the objects ahead fetched (see AHEAD). Returns -1 from the enclosing function on a bad key. */
#define EACH_KEY(first, more, arr, narr, also, body)                            \
    do {                                                                        \
        uint64_t key = (first);                                                 \
        if ((arr) != NULL) {                                                    \
            for (Py_ssize_t _i = 0; _i < (narr) && _i < AHEAD; _i++) ahead(s, table, (arr)[_i]); \
            for (Py_ssize_t _i = 0; _i < (narr) && _i < AHEAD_OBJ; _i++)       \
                ahead_obj(s, table, (arr)[_i], (also));                         \
        }                                                                       \
        body;                                                                   \
        if ((arr) != NULL) {                                                    \
            for (Py_ssize_t _i = 0; _i < (narr); _i++) {                        \
                if (_i + AHEAD < (narr)) ahead(s, table, (arr)[_i + AHEAD]);    \
                if (_i + AHEAD_OBJ < (narr)) ahead_obj(s, table, (arr)[_i + AHEAD_OBJ], (also)); \
                key = (arr)[_i];                                                \
                body;                                                           \
            }                                                                   \
        } else if ((more) != Py_None) {                                         \
            Py_ssize_t _n = PySequence_Fast_GET_SIZE(more);                     \
            for (Py_ssize_t _i = 0; _i < _n; _i++) {                            \
                if (u64(PySequence_Fast_GET_ITEM(more, _i), &key) < 0) return -1; \
                body;                                                           \
            }                                                                   \
        }                                                                       \
    } while (0)

static int note(PyObject *list, uint64_t key) {
    PyObject *k = PyLong_FromUnsignedLongLong(key);
    int rc = k == NULL ? -1 : PyList_Append(list, k);
    Py_XDECREF(k);
    return rc;
}

/* A create, commit or transfer writing `tier`'s copy of each key. With `commit`, the object's
 * commit (identity, tenant, adapter, checksum, nbytes) and its lease (even none) are set;
 * otherwise only a lease it names. */
static int do_write(State *s, uint32_t table, uint64_t first, PyObject *more, const uint64_t *arr,
                    Py_ssize_t narr, int tier, int committed,
                    uint64_t nbytes, uint64_t checksum, int64_t ord, uint32_t identity, uint32_t tenant,
                    uint32_t adapter, int64_t lease, int commit) {
    Copy copy = {nbytes, checksum, ord, (uint64_t)(committed != 0)};
    size_t line = offsetof(Obj, copies) + (size_t)tier * sizeof(Copy);
    /* A fresh key takes the last object freed: those next in line are fetched ahead too. */
    for (uint32_t k = 1; k <= AHEAD_OBJ && k <= s->nfree; k++) ahead_free(s, s->nfree - k, line);
    EACH_KEY(first, more, arr, narr, line, {
        Obj *o = find(s, table, key);
        int fresh = o == NULL;
        if (fresh && (o = born(s, table, key)) == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        if (fresh && s->nfree >= AHEAD_OBJ) ahead_free(s, s->nfree - AHEAD_OBJ, line);
        if (fresh && s->born != NULL && note(s->born, key) < 0) return -1;
        o->copies[tier] = copy;
        o->mask |= (uint8_t)(1u << tier);
        if (commit) {
            o->has_commit = 1;
            o->identity = identity;
            o->tenant = tenant;
            o->adapter = adapter;
            o->commit_checksum = checksum;
            o->commit_nbytes = nbytes;
            o->lease = lease;
        } else if (lease || fresh) {
            o->lease = lease;
        }
    });
    return 0;
}

/* Drop `tier`'s copy of each key; an object left with none is forgotten. */
static int do_evict(State *s, uint32_t table, uint64_t first, PyObject *more, const uint64_t *arr, Py_ssize_t narr,
                    int tier) {
    EACH_KEY(first, more, arr, narr, 0, {
        Obj *o = find(s, table, key);
        if (o != NULL) {
            o->mask &= (uint8_t)~(1u << tier);
            if (!o->mask) {
                if (forget(s, table, key) < 0) {
                    PyErr_NoMemory();
                    return -1;
                }
                if (s->died != NULL && note(s->died, key) < 0) return -1;
            }
        }
    });
    return 0;
}

/* The objects' own invalidation. */
static int do_invalidate(State *s, uint32_t table, uint64_t first, PyObject *more, const uint64_t *arr,
                         Py_ssize_t narr, int64_t ord, int reason) {
    EACH_KEY(first, more, arr, narr, 0, {
        Obj *o = find(s, table, key);
        if (o != NULL) {
            o->inv_ord = ord;
            o->inv_reason = (uint8_t)reason;
        }
    });
    return 0;
}

/* The latest bulk invalidation of one scope of an instance ("" / NONE, id 0: any). */
static int do_bulk(State *s, uint32_t inst, int tier, uint32_t tenant, uint32_t adapter, int64_t ord, int reason) {
    if (inst >= s->nbulk) {
        uint32_t n = inst + 16;
        Scopes *nb = PyMem_RawRealloc(s->bulk, (size_t)n * sizeof(Scopes));
        if (!nb) {
            PyErr_NoMemory();
            return -1;
        }
        memset(nb + s->nbulk, 0, (size_t)(n - s->nbulk) * sizeof(Scopes));
        s->bulk = nb;
        s->nbulk = n;
    }
    Scopes *sc = &s->bulk[inst];
    for (uint32_t i = 0; i < sc->n; i++) {
        Scope *x = &sc->s[i];
        if (x->tier == tier && x->tenant == tenant && x->adapter == adapter) {
            x->ord = ord;
            x->reason = (uint8_t)reason;
            return 0;
        }
    }
    if (sc->n == sc->cap) {
        uint32_t ncap = sc->cap ? sc->cap * 2 : 4;
        Scope *ns = PyMem_RawRealloc(sc->s, (size_t)ncap * sizeof(Scope));
        if (!ns) {
            PyErr_NoMemory();
            return -1;
        }
        sc->s = ns;
        sc->cap = ncap;
    }
    sc->s[sc->n++] = (Scope){ord, tenant, adapter, (uint8_t)tier, (uint8_t)reason};
    return 0;
}

static int do_identity(State *s, uint32_t id, const uint32_t f[6], uint64_t epoch) {
    if (id >= s->nident) {
        uint32_t n = id + 64;
        Ident *ni = PyMem_RawRealloc(s->idents, (size_t)n * sizeof(Ident));
        if (!ni) {
            PyErr_NoMemory();
            return -1;
        }
        memset(ni + s->nident, 0, (size_t)(n - s->nident) * sizeof(Ident));
        s->idents = ni;
        s->nident = n;
    }
    memcpy(s->idents[id].f, f, sizeof(uint32_t) * 6);
    s->idents[id].epoch = epoch;
    return 0;
}

/* bulk(instance, tier, tenant, adapter, ord, reason) */
static PyObject *State_bulk(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(6, "bulk");
    uint32_t inst = (uint32_t)PyLong_AsUnsignedLong(args[0]);
    long tier = PyLong_AsLong(args[1]);
    uint32_t tenant = (uint32_t)PyLong_AsUnsignedLong(args[2]);
    uint32_t adapter = (uint32_t)PyLong_AsUnsignedLong(args[3]);
    int64_t ord;
    if (i64(args[4], &ord) < 0) return NULL;
    long reason = PyLong_AsLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (do_bulk(s, inst, (int)tier, tenant, adapter, ord, (int)reason) < 0) return NULL;
    Py_RETURN_NONE;
}

/* identity(id, model, revision, adapter, transform, kv_dtype, layout, epoch): ids of strings. */
static PyObject *State_identity(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(8, "identity");
    uint32_t id = (uint32_t)PyLong_AsUnsignedLong(args[0]), f[6];
    uint64_t epoch;
    for (int i = 0; i < 6; i++) f[i] = (uint32_t)PyLong_AsUnsignedLong(args[1 + i]);
    if (u64(args[7], &epoch) < 0 || PyErr_Occurred()) return NULL;
    if (do_identity(s, id, f, epoch) < 0) return NULL;
    Py_RETURN_NONE;
}

/* -- one event, read straight from its attributes ------------------------------------------- */

/* Event attribute names, and the wrapper's interning tables (bound once, see State_bind). */
static PyObject *A_kind, *A_instance, *A_group_id, *A_block_key, *A_more_keys, *A_tier, *A_dst_tier, *A_nbytes,
    *A_checksum, *A_lease, *A_reason, *A_tenant, *A_adapter, *A_identity[7];
/* ... and of ObjectState, Copy and Commit (analysis/state.py), for load_objects */
static PyObject *A_copies, *A_commit, *A_committed, *A_ord, *A_identity_field, *A_invalidated_reason, *A_lease_expiry,
    *A_invalidated_ord;

static PyObject *attr(PyObject *o, PyObject *name) { return PyObject_GetAttr(o, name); }

/* The id of `value` in (dict, list), added at the end when new. -1 on error. */
static long intern_in(PyObject *dict, PyObject *list, PyObject *value) {
    PyObject *found = PyDict_GetItemWithError(dict, value);
    if (found != NULL) return PyLong_AsLong(found);
    if (PyErr_Occurred()) return -1;
    Py_ssize_t id = PyList_GET_SIZE(list);
    PyObject *boxed = PyLong_FromSsize_t(id);
    if (boxed == NULL) return -1;
    int bad = PyDict_SetItem(dict, value, boxed) < 0 || PyList_Append(list, value) < 0;
    Py_DECREF(boxed);
    return bad ? -1 : (long)id;
}

/* A code from one of the bound enum maps; -1 (no error set) when absent. */
static long code_of(PyObject *map, PyObject *member) {
    PyObject *found = PyDict_GetItemWithError(map, member);
    return found != NULL ? PyLong_AsLong(found) : -1;
}

/* The id of an identity tuple (IDENTITY_FIELDS' values), registered with its strings when new. */
static long identity_id(State *s, PyObject *key) {
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 7) {
        PyErr_SetString(PyExc_TypeError, "an identity is a tuple of 7 values");
        return -1;
    }
    PyObject *found = PyDict_GetItemWithError(s->identities, key);
    if (found != NULL) return PyLong_AsLong(found);
    if (PyErr_Occurred()) return -1;
    uint32_t f[6];
    uint64_t epoch = 0;
    for (int i = 0; i < 6; i++) {
        long sid = intern_in(s->strings, s->string_list, PyTuple_GET_ITEM(key, i));
        if (sid < 0) return -1;
        f[i] = (uint32_t)sid;
    }
    if (u64(PyTuple_GET_ITEM(key, 6), &epoch) < 0) return -1;
    long id = intern_in(s->identities, s->identity_list, key);
    if (id >= 0 && do_identity(s, (uint32_t)id, f, epoch) < 0) return -1;
    return id;
}

/* The identity id of the event's IDENTITY_FIELDS. */
static long identity_of(State *s, PyObject *event) {
    PyObject *key = PyTuple_New(7);
    if (key == NULL) return -1;
    for (int i = 0; i < 7; i++) {
        PyObject *v = attr(event, A_identity[i]);
        if (v == NULL) {
            Py_DECREF(key);
            return -1;
        }
        PyTuple_SET_ITEM(key, i, v); /* steals */
    }
    long id = identity_id(s, key);
    Py_DECREF(key);
    return id;
}

static int get_u64(PyObject *o, PyObject *name, uint64_t *out) {
    PyObject *v = attr(o, name);
    int rc = v == NULL ? -1 : u64(v, out);
    Py_XDECREF(v);
    return rc;
}

static int get_i64(PyObject *o, PyObject *name, int64_t *out) {
    PyObject *v = attr(o, name);
    int rc = v == NULL ? -1 : i64(v, out);
    Py_XDECREF(v);
    return rc;
}

/* load_objects(table, {block_key: ObjectState}): a table of a `CacheState` (a resumed snapshot),
 * read here object by object (as `load` takes one, without a Python call per object). */
static PyObject *State_load_objects(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(2, "load_objects");
    if (s->kinds == NULL) return PyErr_Format(PyExc_RuntimeError, "load_objects before bind");
    uint32_t table = (uint32_t)PyLong_AsUnsignedLong(args[0]);
    if (PyErr_Occurred()) return NULL;
    if (!PyDict_Check(args[1])) return PyErr_Format(PyExc_TypeError, "load_objects: a dict of objects");
    Py_ssize_t pos = 0;
    PyObject *k, *obj;
    while (PyDict_Next(args[1], &pos, &k, &obj)) {
        uint64_t key;
        if (u64(k, &key) < 0) return NULL;
        if (find(s, table, key) != NULL) return PyErr_Format(PyExc_ValueError, "object loaded twice");
        Obj *o = born(s, table, key);
        if (o == NULL) return PyErr_NoMemory();
        PyObject *copies = attr(obj, A_copies);
        if (copies == NULL) return NULL;
        if (!PyDict_Check(copies)) {
            Py_DECREF(copies);
            return PyErr_Format(PyExc_TypeError, "an object's copies are a dict");
        }
        Py_ssize_t cpos = 0;
        PyObject *tier, *copy;
        while (PyDict_Next(copies, &cpos, &tier, &copy)) {
            long t = code_of(s->tiers, tier);
            uint64_t nb, ck;
            int64_t ord;
            PyObject *committed = attr(copy, A_committed);
            int c = committed == NULL ? -1 : PyObject_IsTrue(committed);
            Py_XDECREF(committed);
            if (t < 0 || c < 0 || get_u64(copy, A_nbytes, &nb) < 0 || get_u64(copy, A_checksum, &ck) < 0 ||
                get_i64(copy, A_ord, &ord) < 0) {
                Py_DECREF(copies);
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a copy's tier the compiled state does not know");
                return NULL;
            }
            o->copies[t] = (Copy){nb, ck, ord, (uint64_t)(c != 0)};
            o->mask |= (uint8_t)(1u << t);
        }
        Py_DECREF(copies);
        PyObject *commit = attr(obj, A_commit);
        if (commit == NULL) return NULL;
        if (commit != Py_None) {
            PyObject *identity = attr(commit, A_identity_field), *tenant = attr(commit, A_tenant);
            long id = identity == NULL ? -1 : identity_id(s, identity);
            long tid = tenant == NULL || id < 0 ? -1 : intern_in(s->strings, s->string_list, tenant);
            Py_XDECREF(identity);
            Py_XDECREF(tenant);
            if (tid < 0 || get_u64(commit, A_checksum, &o->commit_checksum) < 0 ||
                get_u64(commit, A_nbytes, &o->commit_nbytes) < 0) {
                Py_DECREF(commit);
                return NULL;
            }
            o->has_commit = 1;
            o->identity = (uint32_t)id;
            o->tenant = (uint32_t)tid;
            o->adapter = s->idents[id].f[2];
        }
        Py_DECREF(commit);
        PyObject *reason = attr(obj, A_invalidated_reason);
        long r = reason == NULL ? -1 : code_of(s->reasons, reason);
        Py_XDECREF(reason);
        if (r < 0 || get_i64(obj, A_lease_expiry, &o->lease) < 0 || get_i64(obj, A_invalidated_ord, &o->inv_ord) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "an invalidation reason the compiled state does not know");
            return NULL;
        }
        o->inv_reason = (uint8_t)r;
    }
    Py_RETURN_NONE;
}

/* apply(event, ord): CacheState.apply, the event's attributes read here. */
static PyObject *State_apply(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(2, "apply");
    if (s->kinds == NULL) return PyErr_Format(PyExc_RuntimeError, "apply before bind");
    PyObject *event = args[0], *kind = NULL, *instance = NULL, *group = NULL, *more = NULL, *v = NULL;
    PyObject *result = NULL;
    int64_t ord;
    if (i64(args[1], &ord) < 0) return NULL;
    if (s->born != NULL && (PyList_SetSlice(s->born, 0, PY_SSIZE_T_MAX, NULL) < 0 ||
                            PyList_SetSlice(s->died, 0, PY_SSIZE_T_MAX, NULL) < 0))
        return NULL;
    if ((kind = attr(event, A_kind)) == NULL) return NULL;
    long code = code_of(s->kinds, kind);
    Py_DECREF(kind);
    if (code < 0) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE; /* requests, usage samples and probes change no state */
    }
    if ((instance = attr(event, A_instance)) == NULL) return NULL;
    /* changes[instance] += 1 */
    PyObject *count = PyDict_GetItemWithError(s->changes, instance);
    if (count == NULL && PyErr_Occurred()) goto done;
    PyObject *next = PyLong_FromLongLong(count ? PyLong_AsLongLong(count) + 1 : 1);
    if (next == NULL || PyDict_SetItem(s->changes, instance, next) < 0) {
        Py_XDECREF(next);
        goto done;
    }
    Py_DECREF(next);
    uint64_t first;
    if ((v = attr(event, A_block_key)) == NULL || u64(v, &first) < 0) goto done;
    Py_CLEAR(v);
    if ((group = attr(event, A_group_id)) == NULL) goto done;
    if ((more = attr(event, A_more_keys)) == NULL) goto done;
    if (!PyList_Check(more) && !PyTuple_Check(more)) { /* any sequence, as the Python state takes */
        PyObject *fast = PySequence_Fast(more, "more_keys: a sequence");
        Py_SETREF(more, fast);
        if (more == NULL) goto done;
    }
    PyObject *keys = PySequence_Fast_GET_SIZE(more) ? more : Py_None;
    PyObject *scope = PyTuple_Pack(2, instance, group);
    if (scope == NULL) goto done;
    if (code == K_INVALIDATE || code == K_EVICT) {
        long tier = -1, reason = 0;
        if (code == K_INVALIDATE || first == 0) {
            if ((v = attr(event, A_reason)) == NULL || (reason = code_of(s->reasons, v)) < 0) goto bad_code;
            Py_CLEAR(v);
        }
        if (code == K_EVICT || first == 0) {
            if ((v = attr(event, A_tier)) == NULL || (tier = code_of(s->tiers, v)) < 0) goto bad_code;
            Py_CLEAR(v);
        }
        if (code == K_INVALIDATE && first == 0) { /* a bulk invalidation of a scope */
            long inst = intern_in(s->instances, s->instance_list, instance), tenant, adapter;
            if (inst < 0) goto scope_done;
            if ((v = attr(event, A_tenant)) == NULL || (tenant = intern_in(s->strings, s->string_list, v)) < 0)
                goto scope_done;
            Py_CLEAR(v);
            if ((v = attr(event, A_adapter)) == NULL || (adapter = intern_in(s->strings, s->string_list, v)) < 0)
                goto scope_done;
            Py_CLEAR(v);
            if (do_bulk(s, (uint32_t)inst, (int)tier, (uint32_t)tenant, (uint32_t)adapter, ord, (int)reason) == 0)
                result = Py_None;
            goto scope_done;
        }
        PyObject *table = PyDict_GetItemWithError(s->tables, scope);
        if (table == NULL) {
            if (!PyErr_Occurred()) result = Py_None; /* nothing of the scope is held */
            goto scope_done;
        }
        uint32_t tid = (uint32_t)PyLong_AsUnsignedLong(table);
        int rc = code == K_EVICT ? do_evict(s, tid, first, keys, NULL, 0, (int)tier)
                                 : do_invalidate(s, tid, first, keys, NULL, 0, ord, (int)reason);
        if (rc == 0) result = Py_None;
        goto scope_done;
    }
    {
        int transfer = code == K_OFFLOAD || code == K_LOAD, commit = code == K_COMMIT;
        long tier;
        if ((v = attr(event, transfer ? A_dst_tier : A_tier)) == NULL || (tier = code_of(s->tiers, v)) < 0)
            goto bad_code;
        Py_CLEAR(v);
        uint64_t nbytes, checksum;
        int64_t lease = 0;
        if ((v = attr(event, A_nbytes)) == NULL || u64(v, &nbytes) < 0) goto scope_done;
        Py_CLEAR(v);
        if ((v = attr(event, A_checksum)) == NULL || u64(v, &checksum) < 0) goto scope_done;
        Py_CLEAR(v);
        if (commit || transfer) {
            if ((v = attr(event, A_lease)) == NULL || i64(v, &lease) < 0) goto scope_done;
            Py_CLEAR(v);
        }
        if (lease && PySet_Add(s->leased, instance) < 0) goto scope_done;
        PyObject *held = PyDict_GetItemWithError(s->tenants, instance); /* borrowed */
        if (held == NULL) {
            if (PyErr_Occurred() || (v = PySet_New(NULL)) == NULL) goto scope_done;
            if (PyDict_SetItem(s->tenants, instance, v) < 0) goto scope_done;
            held = v;
        }
        long identity = 0, tenant = 0, adapter = 0;
        PyObject *tenant_str = NULL;
        if (commit) {
            if ((tenant_str = attr(event, A_tenant)) == NULL) goto scope_done;
            if (PySet_Add(held, tenant_str) < 0 || (tenant = intern_in(s->strings, s->string_list, tenant_str)) < 0) {
                Py_DECREF(tenant_str);
                goto scope_done;
            }
            Py_DECREF(tenant_str);
            if ((identity = identity_of(s, event)) < 0) goto scope_done;
            adapter = s->idents[identity].f[2];
        } else {
            PyObject *empty = PyUnicode_FromStringAndSize("", 0);
            int bad = empty == NULL || PySet_Add(held, empty) < 0;
            Py_XDECREF(empty);
            if (bad) goto scope_done;
        }
        Py_CLEAR(v);
        if (intern_in(s->instances, s->instance_list, instance) < 0) goto scope_done;
        long tid = intern_in(s->tables, s->table_list, scope);
        if (tid < 0) goto scope_done;
        if (do_write(s, (uint32_t)tid, first, keys, NULL, 0, (int)tier, code != K_CREATE, nbytes, checksum, ord,
                     (uint32_t)identity, (uint32_t)tenant, (uint32_t)adapter, lease, commit) == 0)
            result = Py_None;
        goto scope_done;
    }
bad_code:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "an enum value the compiled state does not know");
scope_done:
    Py_DECREF(scope);
done:
    Py_XDECREF(v);
    Py_XDECREF(instance);
    Py_XDECREF(group);
    Py_XDECREF(more);
    if (result != NULL && s->born != NULL) return PyTuple_Pack(2, s->born, s->died);
    Py_XINCREF(result);
    return result;
}

/* -- a batch of object events, read from its columns ---------------------------------------- */

static void release_requests(State *s) {
    for (int i = 0; i < s->nrb; i++) PyBuffer_Release(&s->rb[i]);
    s->nrb = 0;
    PyMem_RawFree(s->rspec);
    PyMem_RawFree(s->rng);
    PyMem_RawFree(s->rstep);
    s->rspec = NULL, s->rng = NULL, s->rstep = NULL;
    s->nrecipes = s->rwidth = 0;
}

static void release_columns(State *s) {
    release_requests(s);
    for (int i = 0; i < s->ncb; i++) PyBuffer_Release(&s->cb[i]);
    s->ncb = 0;
    s->crows = 0;
    Py_CLEAR(s->cinst);
    Py_CLEAR(s->ctenant);
    PyMem_RawFree(s->ccount);
    s->ccount = NULL;
    PyMem_RawFree(s->ctenant_id);
    s->ctenant_id = NULL;
}

/* load_columns(columns, instances, tenants) or load_columns(None): the batch apply_rows reads
 * (see analysis.columns, which prepares it), held until the next call. `columns` is a tuple of
 * NCOLS contiguous buffers, one value per row (COL_OFFSETS one more: the more keys of row i are
 * values[offsets[i]:offsets[i + 1]]); `instances` and `tenants` are the strings their indices name. */
static PyObject *State_load_columns(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(3, "load_columns");
    release_columns(s);
    if (args[0] == Py_None) Py_RETURN_NONE;
    if (!PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != NCOLS || !PyList_Check(args[1]) ||
        !PyList_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "load_columns: a tuple of %d buffers and two lists", NCOLS);
    for (int i = 0; i < NCOLS; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args[0], i), &s->cb[i], PyBUF_C_CONTIGUOUS) < 0) {
            release_columns(s);
            return NULL;
        }
        s->ncb = i + 1;
    }
    Py_ssize_t n = s->cb[COL_KIND].len;
    for (int i = 0; i < NCOLS; i++) {
        Py_ssize_t want = i == COL_VALUES ? 0 : (n + (i == COL_OFFSETS)) * COL_SIZE[i];
        if (s->cb[i].len < want || s->cb[i].len % COL_SIZE[i]) {
            release_columns(s);
            return PyErr_Format(PyExc_ValueError, "load_columns: column %d holds %zd bytes for %zd rows", i,
                                s->cb[i].len, n);
        }
    }
    Py_ssize_t ni = PyList_GET_SIZE(args[1]), nt = PyList_GET_SIZE(args[2]);
    s->ccount = PyMem_RawCalloc((size_t)(ni ? ni : 1), sizeof(int64_t));
    s->ctenant_id = PyMem_RawMalloc((size_t)(nt ? nt : 1) * sizeof(long));
    if (!s->ccount || !s->ctenant_id) {
        release_columns(s);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nt; i++) s->ctenant_id[i] = -1;
    Py_INCREF(args[1]);
    Py_INCREF(args[2]);
    s->cinst = args[1];
    s->ctenant = args[2];
    s->crows = n;
    Py_RETURN_NONE;
}

#define COL(t, c) ((const t *)s->cb[c].buf)

/* apply_rows(start, stop, base_ord): CacheState.apply for each row of the loaded batch in
 * [start, stop), row i at stream position base_ord + i + 1; every row must be an object event
 * (the wrapper leaves bulk invalidations, requests and the rest to `apply`), or a lookup or
 * adopt of load_requests, judged where it stands in the stream. Tables, identities
 * and enum codes come resolved; the instance's books (changes, tenants, leases) are kept here. */
/* Row kinds of a prepared batch that apply_rows judges itself (load_requests). */
#define K_LOOKUP_ROW (-2)
#define K_ADOPT_ROW (-3)
static int request_row(State *s, Py_ssize_t r, int code);

static PyObject *State_apply_rows(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(3, "apply_rows");
    Py_ssize_t start = PyLong_AsSsize_t(args[0]), stop = PyLong_AsSsize_t(args[1]);
    int64_t base;
    if ((start == -1 || stop == -1 || i64(args[2], &base) < 0) && PyErr_Occurred()) return NULL;
    if (s->kinds == NULL || s->cinst == NULL) return PyErr_Format(PyExc_RuntimeError, "apply_rows before load_columns");
    if (start < 0 || stop > s->crows || start > stop) return PyErr_Format(PyExc_IndexError, "apply_rows: rows out of range");
    const int8_t *kind = COL(int8_t, COL_KIND), *tierc = COL(int8_t, COL_TIER), *reasonc = COL(int8_t, COL_REASON);
    const int32_t *table = COL(int32_t, COL_TABLE), *inst = COL(int32_t, COL_INST), *ident = COL(int32_t, COL_IDENTITY),
                  *tenant = COL(int32_t, COL_TENANT), *offsets = COL(int32_t, COL_OFFSETS);
    const uint64_t *first = COL(uint64_t, COL_KEY), *values = COL(uint64_t, COL_VALUES),
                   *nbytes = COL(uint64_t, COL_NBYTES), *checksum = COL(uint64_t, COL_CHECKSUM);
    const int64_t *lease = COL(int64_t, COL_LEASE);
    Py_ssize_t nvalues = s->cb[COL_VALUES].len / 8, ninst = PyList_GET_SIZE(s->cinst),
               ntenant = PyList_GET_SIZE(s->ctenant);
    PyObject *empty = NULL;
    int failed = 0;
    for (Py_ssize_t r = start; r < stop && !failed; r++) {
        int code = kind[r], tier = tierc[r];
        if (code == K_LOOKUP_ROW || code == K_ADOPT_ROW) {
            failed = request_row(s, r, code) < 0;
            continue;
        }
        int32_t a = offsets[r], b = offsets[r + 1], i = inst[r];
        if (code < K_CREATE || code > K_EVICT || tier < 0 || tier >= NTIERS || a < 0 || b < a || b > nvalues ||
            i < 0 || i >= ninst) {
            PyErr_Format(PyExc_ValueError, "apply_rows: row %zd is not a prepared object event", r);
            failed = 1;
            break;
        }
        s->ccount[i]++;
        if (r + 1 < stop && kind[r + 1] >= K_CREATE && kind[r + 1] <= K_EVICT && table[r + 1] >= 0) {
            /* the next row's first slots, while this row's run is worked on */
            int32_t na = offsets[r + 1], nb = offsets[r + 2];
            ahead(s, (uint32_t)table[r + 1], first[r + 1]);
            for (int32_t k = na; k < nb && k < na + AHEAD && nb <= nvalues; k++) ahead(s, (uint32_t)table[r + 1], values[k]);
        }
        int64_t ord = base + r + 1;
        const uint64_t *more = b > a ? values + a : NULL;
        if (code == K_INVALIDATE || code == K_EVICT) {
            if (table[r] < 0) continue; /* nothing of the scope is held */
            failed = (code == K_EVICT ? do_evict(s, (uint32_t)table[r], first[r], Py_None, more, b - a, tier)
                                      : do_invalidate(s, (uint32_t)table[r], first[r], Py_None, more, b - a, ord,
                                                      reasonc[r])) < 0;
            continue;
        }
        PyObject *name = PyList_GET_ITEM(s->cinst, i);
        int transfer = code == K_OFFLOAD || code == K_LOAD, commit = code == K_COMMIT;
        int64_t leased = commit || transfer ? lease[r] : 0;
        if (leased && PySet_Add(s->leased, name) < 0) {
            failed = 1;
            break;
        }
        PyObject *held = PyDict_GetItemWithError(s->tenants, name); /* borrowed */
        if (held == NULL) {
            PyObject *fresh = PyErr_Occurred() ? NULL : PySet_New(NULL);
            if (fresh == NULL || PyDict_SetItem(s->tenants, name, fresh) < 0) {
                Py_XDECREF(fresh);
                failed = 1;
                break;
            }
            Py_DECREF(fresh);
            held = PyDict_GetItem(s->tenants, name);
        }
        uint32_t identity = 0, tid = 0, adapter = 0;
        if (commit) {
            int32_t t = tenant[r];
            if (t < 0 || t >= ntenant || ident[r] < 0 || (uint32_t)ident[r] >= s->nident) {
                PyErr_Format(PyExc_ValueError, "apply_rows: row %zd names no tenant or identity", r);
                failed = 1;
                break;
            }
            PyObject *tname = PyList_GET_ITEM(s->ctenant, t);
            if (s->ctenant_id[t] < 0 && (s->ctenant_id[t] = intern_in(s->strings, s->string_list, tname)) < 0) {
                failed = 1;
                break;
            }
            if (PySet_Add(held, tname) < 0) {
                failed = 1;
                break;
            }
            identity = (uint32_t)ident[r];
            tid = (uint32_t)s->ctenant_id[t];
            adapter = s->idents[identity].f[2];
        } else {
            if (empty == NULL && (empty = PyUnicode_FromStringAndSize("", 0)) == NULL) {
                failed = 1;
                break;
            }
            if (PySet_Add(held, empty) < 0) {
                failed = 1;
                break;
            }
        }
        if (table[r] < 0) {
            PyErr_Format(PyExc_ValueError, "apply_rows: row %zd writes to no table", r);
            failed = 1;
            break;
        }
        failed = do_write(s, (uint32_t)table[r], first[r], Py_None, more, b - a, tier, code != K_CREATE, nbytes[r],
                          checksum[r], ord, identity, tid, adapter, leased, commit) < 0;
    }
    Py_XDECREF(empty);
    /* changes[instance] += the batch's object events of it (also when a row failed: those before it were applied) */
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    if (failed) PyErr_Fetch(&et, &ev, &etb);
    for (Py_ssize_t i = 0; i < ninst; i++) {
        if (!s->ccount[i]) continue;
        PyObject *name = PyList_GET_ITEM(s->cinst, i), *count = PyDict_GetItemWithError(s->changes, name);
        PyObject *next = count == NULL && PyErr_Occurred() ? NULL
                       : PyLong_FromLongLong((count ? PyLong_AsLongLong(count) : 0) + s->ccount[i]);
        s->ccount[i] = 0;
        if (next == NULL || PyDict_SetItem(s->changes, name, next) < 0) failed = 1;
        Py_XDECREF(next);
    }
    if (et != NULL) PyErr_Restore(et, ev, etb);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* track(): from now on, apply returns (born keys, forgotten keys) of each event (the fleet
 * view's index is kept by the wrapper). */
static PyObject *State_track(State *s, PyObject *unused) {
    if (s->born == NULL && ((s->born = PyList_New(0)) == NULL || (s->died = PyList_New(0)) == NULL)) return NULL;
    Py_RETURN_NONE;
}

/* bind(kinds, tiers, reasons, strings, string_list, tables, table_list, instances, instance_list,
 *      identities, identity_list, changes, leased, tenants): the wrapper's maps, shared. */
static PyObject *State_bind(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(14, "bind");
    PyObject **slots[14] = {&s->kinds, &s->tiers, &s->reasons, &s->strings, &s->string_list, &s->tables,
                            &s->table_list, &s->instances, &s->instance_list, &s->identities, &s->identity_list,
                            &s->changes, &s->leased, &s->tenants};
    for (int i = 0; i < 14; i++) {
        int list = i == 4 || i == 6 || i == 8 || i == 10, set = i == 12;
        if (list ? !PyList_Check(args[i]) : set ? !PySet_Check(args[i]) : !PyDict_Check(args[i]))
            return PyErr_Format(PyExc_TypeError, "bind: argument %d has the wrong type", i);
    }
    for (int i = 0; i < 14; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*slots[i], args[i]);
    }
    Py_RETURN_NONE;
}

/* -- evaluation ------------------------------------------------------------------------------ */

/* The latest invalidation that applies to o's copy on `tier` (CacheState.invalidation). */
static inline void invalidation(const State *s, uint32_t inst, const Obj *o, int tier, int64_t *ord, uint8_t *reason) {
    *ord = o->inv_ord;
    *reason = o->inv_reason;
    if (inst >= s->nbulk) return;
    const Scopes *sc = &s->bulk[inst];
    uint32_t tenant = o->has_commit ? o->tenant : 0, adapter = o->has_commit ? o->adapter : 0;
    for (uint32_t i = 0; i < sc->n; i++) {
        const Scope *x = &sc->s[i];
        if ((x->tier == T_NONE || x->tier == tier) && (x->tenant == 0 || x->tenant == tenant) &&
            (x->adapter == 0 || x->adapter == adapter) && x->ord > *ord) {
            *ord = x->ord;
            *reason = x->reason;
        }
    }
}

typedef struct {
    uint32_t inst, identity, tenant;
    int64_t ts;
} Request;

/* check_object: is this block usable by this request now? The first failing rule names the reason. */
static void check(const State *s, const Request *rq, const Obj *o, int component, uint8_t missing, Check *out) {
    memset(out, 0, sizeof(Check));
    if (o == NULL || !o->mask) {
        out->reason = missing;
        return;
    }
    int best = S_INVALIDATED, good = 0;
    int64_t by_ord = 0;
    uint8_t by_reason = 0;
    for (int t = 0; t < NTIERS; t++) {
        if (!(o->mask & (1u << t))) continue;
        const Copy *c = &o->copies[t];
        int64_t iord;
        uint8_t ireason;
        invalidation(s, rq->inst, o, t, &iord, &ireason);
        int status;
        if (iord > c->ord) {
            status = S_INVALIDATED;
            if (iord > by_ord) {
                by_ord = iord;
                by_reason = ireason;
            }
        } else if (!c->committed) {
            status = S_UNCOMMITTED;
        } else if (o->has_commit && o->commit_checksum && c->checksum && c->checksum != o->commit_checksum) {
            status = S_CORRUPT;
        } else {
            status = S_OK;
            good |= 1 << t;
        }
        if (status > best) best = status;
    }
    out->present = 1;
    uint8_t reason = G_NONE;
    if (best == S_INVALIDATED) {
        reason = by_reason == s->rollback ? G_ROLLBACK : G_INVALIDATED;
        out->dkind = D_REASON;
        out->darg = by_reason;
    } else if (best == S_UNCOMMITTED) {
        reason = G_UNCOMMITTED;
    } else if (best == S_CORRUPT) {
        reason = G_CHECKSUM;
    } else if (!o->has_commit) {
        reason = G_UNCOMMITTED;
        out->dkind = D_NO_COMMIT;
    } else {
        int shared = 0;
        for (uint32_t i = 0; i < s->nshared; i++) shared |= s->shared[i] == o->tenant;
        if (o->tenant != rq->tenant && !shared) {
            reason = G_TENANT;
            out->dkind = D_TENANT;
            out->darg = o->tenant;
        } else if (o->identity != rq->identity) {
            const Ident *have = &s->idents[o->identity], *want = &s->idents[rq->identity];
            for (int i = 0; i < 7; i++) {
                uint64_t h = i < 6 ? have->f[i] : have->epoch, w = i < 6 ? want->f[i] : want->epoch;
                if (h != w && (i == 2 || (h && w))) {
                    reason = (component == C_INDEXER && i == 6) ? G_INDEXER : G_IDENTITY;
                    out->dkind = D_IDENTITY;
                    out->darg = (uint32_t)i;
                    out->darg2 = o->identity;
                    break;
                }
            }
        }
        if (reason == G_NONE && o->lease && o->lease <= rq->ts) reason = G_LEASE;
    }
    if (reason != G_NONE) {
        out->reason = reason;
        return;
    }
    if (good & (1 << T_DEVICE)) {
        out->usable = out->resident = 1;
        out->rtier = T_DEVICE;
        return;
    }
    int source = -1;
    for (int t = 0; t < NTIERS; t++)
        if ((good & (1 << t)) && (source < 0 || TIER_RANK[t] < TIER_RANK[source])) source = t;
    out->usable = 1;
    out->reason = G_NOT_RESIDENT;
    out->dkind = D_TIER;
    out->darg = (uint32_t)source;
    out->rtier = (uint8_t)source;
    out->rbytes = o->copies[source].nbytes ? o->copies[source].nbytes : (o->has_commit ? o->commit_nbytes : 0);
}

typedef struct {
    int64_t group_id, component, b, window, ratio;
    uint8_t missing;
    Py_ssize_t n; /* blocks in the request's chain for this group */
    Check *checks;
    int32_t *present, *usable, *resident; /* prefix sums, n + 1 each */
} View;

static inline void needed(const View *v, int64_t p, int64_t *start, int64_t *stop) {
    int64_t b = v->b;
    if (p <= 0) {
        *start = *stop = 0;
        return;
    }
    *stop = p / b;
    switch (v->component) {
    case C_SLIDING:
        *start = (p - v->window > 0 ? p - v->window : 0) / b;
        break;
    case C_MAMBA:
        *start = p / b - 1;
        break;
    case C_TAIL:
        *start = (p / v->ratio) * v->ratio / b;
        break;
    default:
        *start = 0;
    }
    if (*stop < *start) *stop = *start; /* an empty range, as Python's */
}

static inline int all_of(const View *v, const int32_t *sums, int64_t p) {
    int64_t start, stop;
    needed(v, p, &start, &stop);
    if (stop == start) return 1;
    if (stop > v->n || start < 0) return 0;
    return sums[stop] - sums[start] == stop - start;
}

static int64_t hash_hit(const View *v, int64_t cap) {
    if (!v->present[v->n]) return 0;
    for (int64_t p = cap / v->b * v->b; p > 0; p -= v->b) {
        int64_t start, stop;
        needed(v, p, &start, &stop);
        if (stop > start && stop <= v->n && start >= 0 && v->present[stop] - v->present[start] == stop - start)
            return p;
    }
    return 0;
}

/* One group of a recipe, as evaluate reads it (GroupSpec). */
typedef struct GSpec_ {
    int64_t group_id, component, b, window, ratio;
    uint8_t missing;
} GSpec;

/* What evaluating one lookup gives (the wrapper's Evaluation, in codes). */
typedef struct {
    int64_t logical, recoverable, resident;
    long reason, group;
    int dkind, norder;
    unsigned long long darg, darg2;
    int64_t group_logical[64];
    uint64_t restore[NTIERS];
    int order[NTIERS]; /* the tiers of `restore`, in the order first met */
} Eval;

static int parse_groups(PyObject *groups, GSpec *out, Py_ssize_t *ng) {
    if (!PyTuple_Check(groups)) return PyErr_Format(PyExc_TypeError, "the groups are a tuple"), -1;
    *ng = PyTuple_GET_SIZE(groups);
    if (*ng > 64) return PyErr_Format(PyExc_ValueError, "at most 64 groups"), -1;
    for (Py_ssize_t g = 0; g < *ng; g++) {
        PyObject *spec = PyTuple_GET_ITEM(groups, g);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 6)
            return PyErr_Format(PyExc_TypeError, "a group is a tuple of 6"), -1;
        GSpec *v = &out[g];
        v->group_id = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 0));
        v->component = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 1));
        v->b = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 2));
        v->window = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 3));
        v->ratio = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 4));
        v->missing = (uint8_t)PyLong_AsLong(PyTuple_GET_ITEM(spec, 5));
        if (PyErr_Occurred()) return -1;
        if (v->b <= 0 || v->group_id < 0 || (v->component == C_TAIL && v->ratio <= 0))
            return PyErr_Format(PyExc_ValueError, "bad group"), -1;
    }
    return 0;
}

/* `evaluate` itself: the lookup `rq` against groups `specs`, group g's blocks being
 * chains[g][0:lens[g]] in table tables[g] (-1: none). Returns -1 (no exception set) when out of memory. */
static int eval_core(State *s, const Request *rq, const GSpec *specs, Py_ssize_t ng, const int32_t *tables,
                     const uint64_t *const *chains, const Py_ssize_t *lens, int64_t step, int64_t cap,
                     int64_t explain, Eval *out) {
    View views[64];
    size_t blocks = 0;
    for (Py_ssize_t g = 0; g < ng; g++) blocks += (size_t)lens[g] + 1;
    if (ensure_scratch(s, blocks, (size_t)ng) < 0) return -1;
    size_t off = 0;
    for (Py_ssize_t g = 0; g < ng; g++) {
        View *v = &views[g];
        const GSpec *sp = &specs[g];
        v->group_id = sp->group_id, v->component = sp->component, v->b = sp->b, v->window = sp->window;
        v->ratio = sp->ratio, v->missing = sp->missing, v->n = lens[g];
        v->checks = s->checks + off;
        v->present = s->sums + off * 3;
        v->usable = v->present + v->n + 1;
        v->resident = v->usable + v->n + 1;
        off += (size_t)v->n + 1;
        int32_t table = tables[g];
        v->present[0] = v->usable[0] = v->resident[0] = 0;
        for (Py_ssize_t i = 0; table >= 0 && i < v->n && i < AHEAD; i++) ahead(s, (uint32_t)table, chains[g][i]);
        for (Py_ssize_t i = 0; i < v->n; i++) {
            if (table >= 0 && i + AHEAD < v->n) ahead(s, (uint32_t)table, chains[g][i + AHEAD]);
            uint64_t key = chains[g][i];
            const Obj *o = (table >= 0 && key != 0) ? find(s, (uint32_t)table, key) : NULL;
            Check *c = &v->checks[i];
            check(s, rq, o, (int)v->component, v->missing, c);
            v->present[i + 1] = v->present[i] + c->present;
            v->usable[i + 1] = v->usable[i] + c->usable;
            v->resident[i + 1] = v->resident[i] + c->resident;
        }
    }
    int64_t logical = 0;
    for (Py_ssize_t g = 0; g < ng; g++) {
        int64_t h = hash_hit(&views[g], cap);
        if (h > logical) logical = h;
        out->group_logical[g] = h;
    }
    int64_t top = logical / step * step, recoverable = top;
    for (; recoverable > 0; recoverable -= step) {
        int ok = 1;
        for (Py_ssize_t g = 0; g < ng && ok; g++) ok = all_of(&views[g], views[g].usable, recoverable);
        if (ok) break;
    }
    if (recoverable < 0) recoverable = 0;
    int64_t resident = recoverable;
    for (; resident > 0; resident -= step) {
        int ok = 1;
        for (Py_ssize_t g = 0; g < ng && ok; g++) ok = all_of(&views[g], views[g].resident, resident);
        if (ok) break;
    }
    if (resident < 0) resident = 0;
    long reason = G_NONE, group_id = -1;
    int dkind = D_NONE;
    unsigned long long darg = 0, darg2 = 0;
    int64_t target = explain ? explain / step * step : top;
    if (recoverable < target) {
        for (Py_ssize_t g = 0; g < ng && group_id < 0; g++) {
            const View *v = &views[g];
            int64_t start, stop;
            needed(v, target, &start, &stop);
            for (int64_t i = start; i < stop; i++) {
                if (i >= v->n) {
                    reason = v->missing, dkind = D_BEYOND, group_id = (long)v->group_id;
                    break;
                }
                const Check *c = &v->checks[i < 0 ? v->n + i : i];
                if (!c->usable) {
                    reason = c->reason, dkind = c->dkind, darg = c->darg, darg2 = c->darg2;
                    group_id = (long)v->group_id;
                    break;
                }
            }
        }
    } else if (top < logical) {
        reason = G_MISALIGNED, dkind = D_MISALIGNED, darg = (unsigned long long)logical;
        darg2 = (unsigned long long)step;
    }
    memset(out->restore, 0, sizeof(out->restore));
    int norder = 0, seen = 0;
    if (resident < recoverable) {
        for (Py_ssize_t g = 0; g < ng; g++) {
            const View *v = &views[g];
            int64_t start, stop;
            needed(v, recoverable, &start, &stop);
            for (int64_t i = start; i < stop; i++) {
                const Check *c = &v->checks[i < 0 ? v->n + i : i];
                if (!c->resident) {
                    if (!(seen & (1 << c->rtier))) {
                        seen |= 1 << c->rtier;
                        out->order[norder++] = c->rtier;
                    }
                    out->restore[c->rtier] += c->rbytes;
                }
            }
        }
    }
    out->logical = logical, out->recoverable = recoverable, out->resident = resident;
    out->reason = reason, out->group = group_id, out->dkind = dkind, out->darg = darg, out->darg2 = darg2;
    out->norder = norder;
    return 0;
}

static int ensure_keys(State *s, size_t n) {
    if (n <= s->kcap) return 0;
    uint64_t *nk = PyMem_RawRealloc(s->keys, n * 2 * sizeof(uint64_t));
    if (!nk) return -1;
    s->keys = nk;
    s->kcap = n * 2;
    return 0;
}

/* evaluate(instance, tables, chains, groups, step, cap, identity, tenant, ts, explain_up_to)
 *   tables: per group (in `groups`' order), the table id of (instance, group), or -1
 *   chains: the lookup's group_block_keys
 *   groups: per group, (group_id, component, block_size, window, ratio, missing reason)
 * -> (logical, recoverable, resident, reason, reason_group, detail kind, detail arg, detail arg 2,
 *     group_logical, ((restore tier, bytes), ...)) */
static PyObject *State_evaluate(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(10, "evaluate");
    Request rq;
    rq.inst = (uint32_t)PyLong_AsUnsignedLong(args[0]);
    PyObject *tables = args[1], *chains = args[2], *groups = args[3];
    int64_t step, cap, explain;
    if (i64(args[4], &step) < 0 || i64(args[5], &cap) < 0) return NULL;
    rq.identity = (uint32_t)PyLong_AsUnsignedLong(args[6]);
    rq.tenant = (uint32_t)PyLong_AsUnsignedLong(args[7]);
    if (i64(args[8], &rq.ts) < 0 || i64(args[9], &explain) < 0) return NULL;
    if (PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(tables) || !PyTuple_Check(groups))
        return PyErr_Format(PyExc_TypeError, "evaluate: tables and groups are tuples");
    if (!(PyList_Check(chains) || PyTuple_Check(chains)))
        return PyErr_Format(PyExc_TypeError, "evaluate: the chains are a list or a tuple");
    if (rq.identity >= s->nident) return PyErr_Format(PyExc_ValueError, "identity %u not registered", rq.identity);
    if (step <= 0) return PyErr_Format(PyExc_ValueError, "evaluate: the alignment must be positive");
    GSpec specs[64];
    Py_ssize_t ng, nchains = PySequence_Fast_GET_SIZE(chains), lens[64];
    int32_t tab[64];
    if (parse_groups(groups, specs, &ng) < 0) return NULL;
    if (PyTuple_GET_SIZE(tables) != ng) return PyErr_Format(PyExc_ValueError, "evaluate: one table per group");
    PyObject *chain_of[64];
    size_t total = 0;
    for (Py_ssize_t g = 0; g < ng; g++) {
        PyObject *chain = specs[g].group_id < nchains ? PySequence_Fast_GET_ITEM(chains, specs[g].group_id) : NULL;
        if (chain != NULL && !(PyList_Check(chain) || PyTuple_Check(chain)))
            return PyErr_Format(PyExc_TypeError, "a chain is a list or a tuple");
        chain_of[g] = chain;
        lens[g] = chain ? PySequence_Fast_GET_SIZE(chain) : 0;
        total += (size_t)lens[g];
        tab[g] = (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(tables, g));
    }
    if (PyErr_Occurred()) return NULL;
    if (ensure_keys(s, total + 1) < 0) return PyErr_NoMemory();
    const uint64_t *keys_of[64];
    size_t at = 0;
    for (Py_ssize_t g = 0; g < ng; g++) {
        keys_of[g] = s->keys + at;
        for (Py_ssize_t i = 0; i < lens[g]; i++)
            if (u64(PySequence_Fast_GET_ITEM(chain_of[g], i), &s->keys[at++]) < 0) return NULL;
    }
    Eval e;
    if (eval_core(s, &rq, specs, ng, tab, keys_of, lens, step, cap, explain, &e) < 0) return PyErr_NoMemory();
    PyObject *group_logical = PyTuple_New(ng);
    if (!group_logical) return NULL;
    for (Py_ssize_t g = 0; g < ng; g++) PyTuple_SET_ITEM(group_logical, g, PyLong_FromLongLong(e.group_logical[g]));
    PyObject *rest = PyTuple_New(e.norder);
    if (!rest) {
        Py_DECREF(group_logical);
        return NULL;
    }
    for (int i = 0; i < e.norder; i++)
        PyTuple_SET_ITEM(rest, i, Py_BuildValue("(iK)", e.order[i], (unsigned long long)e.restore[e.order[i]]));
    return Py_BuildValue("(LLLllkKKNN)", (long long)e.logical, (long long)e.recoverable, (long long)e.resident,
                         e.reason, e.group, (unsigned long)e.dkind, e.darg, e.darg2, group_logical, rest);
}

/* -- lookups and adopts judged from a batch's columns ------------------------------------------ */

/* load_requests's buffers, in its order, each one's item size, and its rows (N: one per row of
 * the batch, N1: one more, W: `width` per row, T: NTIERS per row, 0: any). */
enum { RQ_RECIPE, RQ_PAIR, RQ_INSTID, RQ_IDENT, RQ_TSID, RQ_TS, RQ_CAP, RQ_ADOPTED, RQ_OUTER, RQ_INNER, RQ_KEYS,
       RQ_TABLES, RQ_OUT, RQ_GLOG, RQ_RESTORE, NRQ };
enum { PER_ROW, PER_ROW_1, PER_ROW_W, PER_ROW_T, PER_ROW_OUT, ANY };
static const Py_ssize_t RQ_SIZE[NRQ] = {4, 4, 4, 4, 4, 8, 8, 8, 4, 4, 8, 4, 8, 8, 8};
static const int RQ_ROWS[NRQ] = {PER_ROW, PER_ROW, PER_ROW, PER_ROW, PER_ROW, PER_ROW, PER_ROW, PER_ROW, PER_ROW_1,
                                 ANY, ANY, PER_ROW_W, PER_ROW_OUT, PER_ROW_W, PER_ROW_T};
/* The columns of RQ_OUT, per row: a lookup's evaluation at its place in the stream; an adopt's, of
 * its lookup again at the adopt (when RQ_CHANGED is set), and whether it reused another tenant's state. */
enum { O_LOGICAL, O_RECOVERABLE, O_RESIDENT, O_REASON, O_GROUP, O_DKIND, O_DARG, O_DARG2, O_CHANGES, O_FLAGS, NOUT };
#define F_CHANGED 1
#define F_CROSS 2
#define F_TIERS_SHIFT 8 /* the tiers `restore` names, a bit each */

#define RQ(t, c) ((t *)s->rb[c].buf)

/* load_requests(buffers, recipes, width): after load_columns, the batch's lookups and adopts that
 * apply_rows judges (rows whose kind is K_LOOKUP_ROW or K_ADOPT_ROW; see analysis.requests,
 * which prepares them). `recipes`: per recipe, (groups, alignment) as evaluate takes them;
 * `width`: the most groups of any. A lookup row names its recipe, instance id, identity, tenant
 * id, time, hit cap, key chains (RQ_OUTER into RQ_INNER into RQ_KEYS) and per group its table;
 * an adopt row its lookup's row (earlier in the batch), time and tokens reused. The results go
 * to RQ_OUT, RQ_GLOG and RQ_RESTORE, which must be writable. */
static PyObject *State_load_requests(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(3, "load_requests");
    release_requests(s);
    if (s->cinst == NULL) return PyErr_Format(PyExc_RuntimeError, "load_requests before load_columns");
    PyObject *bufs = args[0], *recipes = args[1];
    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    if (width == -1 && PyErr_Occurred()) return NULL;
    if (!PyTuple_Check(bufs) || PyTuple_GET_SIZE(bufs) != NRQ || !PyTuple_Check(recipes) || width < 1 || width > 64)
        return PyErr_Format(PyExc_TypeError, "load_requests: a tuple of %d buffers, a tuple of recipes, 1..64", NRQ);
    for (int i = 0; i < NRQ; i++) {
        int writable = i >= RQ_OUT;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(bufs, i), &s->rb[i],
                               writable ? PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE : PyBUF_C_CONTIGUOUS) < 0) {
            release_requests(s);
            return NULL;
        }
        s->nrb = i + 1;
    }
    Py_ssize_t n = s->crows;
    for (int i = 0; i < NRQ; i++) {
        Py_ssize_t rows = RQ_ROWS[i] == PER_ROW ? n : RQ_ROWS[i] == PER_ROW_1 ? n + 1
                        : RQ_ROWS[i] == PER_ROW_W ? n * width : RQ_ROWS[i] == PER_ROW_T ? n * NTIERS
                        : RQ_ROWS[i] == PER_ROW_OUT ? n * NOUT : 0;
        if (s->rb[i].len < rows * RQ_SIZE[i] || s->rb[i].len % RQ_SIZE[i]) {
            release_requests(s);
            return PyErr_Format(PyExc_ValueError, "load_requests: buffer %d holds %zd bytes for %zd rows", i,
                                s->rb[i].len, n);
        }
    }
    Py_ssize_t nr = PyTuple_GET_SIZE(recipes);
    s->rspec = PyMem_RawMalloc((size_t)(nr ? nr : 1) * 64 * sizeof(GSpec));
    s->rng = PyMem_RawMalloc((size_t)(nr ? nr : 1) * sizeof(Py_ssize_t));
    s->rstep = PyMem_RawMalloc((size_t)(nr ? nr : 1) * sizeof(int64_t));
    if (!s->rspec || !s->rng || !s->rstep) {
        release_requests(s);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t r = 0; r < nr; r++) {
        PyObject *one = PyTuple_GET_ITEM(recipes, r);
        if (!PyTuple_Check(one) || PyTuple_GET_SIZE(one) != 2) {
            release_requests(s);
            return PyErr_Format(PyExc_TypeError, "load_requests: a recipe is (groups, alignment)");
        }
        if (parse_groups(PyTuple_GET_ITEM(one, 0), s->rspec + r * 64, &s->rng[r]) < 0 ||
            i64(PyTuple_GET_ITEM(one, 1), &s->rstep[r]) < 0) {
            release_requests(s);
            return NULL;
        }
        if (s->rstep[r] <= 0 || s->rng[r] > width) {
            release_requests(s);
            return PyErr_Format(PyExc_ValueError, "load_requests: recipe %zd: alignment or width", r);
        }
    }
    s->nrecipes = nr;
    s->rwidth = width;
    Py_RETURN_NONE;
}

/* The instance's state changes so far (CacheState.changes_of), this batch's not yet added included. */
static int changes_now(State *s, int32_t i, int64_t *out) {
    PyObject *count = PyDict_GetItemWithError(s->changes, PyList_GET_ITEM(s->cinst, i));
    if (count == NULL && PyErr_Occurred()) return -1;
    *out = (count ? PyLong_AsLongLong(count) : 0) + s->ccount[i];
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Evaluate the lookup of row l at time ts (explaining up to `explain`), from its columns. */
static int lookup_eval(State *s, Py_ssize_t l, int64_t ts, int64_t explain, Eval *e) {
    int32_t rec = RQ(int32_t, RQ_RECIPE)[l], ident = RQ(int32_t, RQ_IDENT)[l], tsid = RQ(int32_t, RQ_TSID)[l];
    if (rec < 0 || rec >= s->nrecipes || ident < 0 || (uint32_t)ident >= s->nident || tsid < 0) {
        PyErr_Format(PyExc_ValueError, "load_requests: row %zd names no recipe, identity or tenant", l);
        return -1;
    }
    Request rq = {.inst = RQ(uint32_t, RQ_INSTID)[l], .identity = (uint32_t)ident, .tenant = (uint32_t)tsid, .ts = ts};
    const GSpec *specs = s->rspec + rec * 64;
    Py_ssize_t ng = s->rng[rec], lens[64];
    const int32_t *outer = RQ(int32_t, RQ_OUTER), *inner = RQ(int32_t, RQ_INNER);
    Py_ssize_t ninner = s->rb[RQ_INNER].len / 4, nkeys = s->rb[RQ_KEYS].len / 8;
    int32_t a = outer[l], b = outer[l + 1];
    if (a < 0 || b < a || b >= ninner) {
        PyErr_Format(PyExc_ValueError, "load_requests: row %zd's chains are out of range", l);
        return -1;
    }
    const uint64_t *chains[64];
    for (Py_ssize_t g = 0; g < ng; g++) {
        int64_t gid = specs[g].group_id;
        lens[g] = 0;
        chains[g] = NULL;
        if (gid < b - a) {
            int32_t lo = inner[a + gid], hi = inner[a + gid + 1];
            if (lo < 0 || hi < lo || hi > nkeys) {
                PyErr_Format(PyExc_ValueError, "load_requests: row %zd's keys are out of range", l);
                return -1;
            }
            chains[g] = RQ(uint64_t, RQ_KEYS) + lo;
            lens[g] = hi - lo;
        }
    }
    if (eval_core(s, &rq, specs, ng, RQ(int32_t, RQ_TABLES) + l * s->rwidth, chains, lens, s->rstep[rec],
                  RQ(int64_t, RQ_CAP)[l], explain, e) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void put_eval(State *s, Py_ssize_t r, const Eval *e) {
    int64_t *out = RQ(int64_t, RQ_OUT) + r * NOUT;
    out[O_LOGICAL] = e->logical, out[O_RECOVERABLE] = e->recoverable, out[O_RESIDENT] = e->resident;
    out[O_REASON] = e->reason, out[O_GROUP] = e->group, out[O_DKIND] = e->dkind;
    out[O_DARG] = (int64_t)e->darg, out[O_DARG2] = (int64_t)e->darg2;
}

/* Did the adopt of row a reuse, in its first `adopted` tokens, a block committed under another
 * tenant than its lookup's (row l)? (Reconstructor._cross_tenant) */
static int cross_tenant(State *s, Py_ssize_t l, int64_t adopted) {
    int32_t rec = RQ(int32_t, RQ_RECIPE)[l];
    const GSpec *specs = s->rspec + rec * 64;
    const int32_t *outer = RQ(int32_t, RQ_OUTER), *inner = RQ(int32_t, RQ_INNER), *tables = RQ(int32_t, RQ_TABLES);
    uint32_t want = (uint32_t)RQ(int32_t, RQ_TSID)[l];
    int32_t a = outer[l], b = outer[l + 1];
    for (Py_ssize_t g = 0; g < s->rng[rec]; g++) {
        View v = {.group_id = specs[g].group_id, .component = specs[g].component, .b = specs[g].b,
                  .window = specs[g].window, .ratio = specs[g].ratio};
        int64_t start, stop, gid = v.group_id;
        if (gid >= b - a) continue; /* no chain: every index is past its end */
        const uint64_t *chain = RQ(uint64_t, RQ_KEYS) + inner[a + gid];
        int64_t n = inner[a + gid + 1] - inner[a + gid], table = tables[l * s->rwidth + g];
        needed(&v, adopted / v.b * v.b, &start, &stop);
        for (int64_t i = start; i < stop && i < n; i++) {
            const Obj *o = table >= 0 && i >= 0 ? find(s, (uint32_t)table, chain[i]) : NULL;
            if (o != NULL && (o->has_commit ? o->tenant : 0) != want) return 1;
        }
    }
    return 0;
}

static int request_row(State *s, Py_ssize_t r, int code) {
    if (s->nrb != NRQ) {
        PyErr_Format(PyExc_ValueError, "apply_rows: row %zd is a request, and none were loaded", r);
        return -1;
    }
    const int32_t *inst = COL(int32_t, COL_INST), *tenant = COL(int32_t, COL_TENANT);
    const int8_t *kind = COL(int8_t, COL_KIND);
    int64_t *out = RQ(int64_t, RQ_OUT);
    Py_ssize_t ninst = PyList_GET_SIZE(s->cinst), ntenant = PyList_GET_SIZE(s->ctenant);
    Eval e;
    if (code == K_LOOKUP_ROW) {
        if (inst[r] < 0 || inst[r] >= ninst) return PyErr_Format(PyExc_ValueError, "row %zd: no instance", r), -1;
        if (lookup_eval(s, r, RQ(int64_t, RQ_TS)[r], 0, &e) < 0) return -1;
        put_eval(s, r, &e);
        int64_t *o = out + r * NOUT, mask = 0;
        if (changes_now(s, inst[r], &o[O_CHANGES]) < 0) return -1;
        for (Py_ssize_t g = 0; g < s->rng[RQ(int32_t, RQ_RECIPE)[r]]; g++)
            RQ(int64_t, RQ_GLOG)[r * s->rwidth + g] = e.group_logical[g];
        for (int t = 0; t < NTIERS; t++) RQ(uint64_t, RQ_RESTORE)[r * NTIERS + t] = e.restore[t];
        for (int i = 0; i < e.norder; i++) mask |= (int64_t)1 << e.order[i];
        o[O_FLAGS] = mask << F_TIERS_SHIFT;
        return 0;
    }
    /* an adopt: judged again at use unless nothing could have changed since its lookup
     * (Reconstructor._result's rule), and checked for reuse across tenants */
    int32_t l = RQ(int32_t, RQ_PAIR)[r];
    if (l < 0 || l >= r || kind[l] != K_LOOKUP_ROW || inst[l] < 0 || inst[l] >= ninst || tenant[l] < 0 ||
        tenant[l] >= ntenant)
        return PyErr_Format(PyExc_ValueError, "apply_rows: row %zd adopts no lookup before it", r), -1;
    int64_t *o = out + r * NOUT, now;
    o[O_FLAGS] = 0;
    PyObject *name = PyList_GET_ITEM(s->cinst, inst[l]);
    if (changes_now(s, inst[l], &now) < 0) return -1;
    int leased = PySet_Contains(s->leased, name);
    if (leased < 0) return -1;
    if (now != out[l * NOUT + O_CHANGES] || leased) {
        if (lookup_eval(s, l, RQ(int64_t, RQ_TS)[r], out[l * NOUT + O_RECOVERABLE], &e) < 0) return -1;
        put_eval(s, r, &e);
        o[O_FLAGS] |= F_CHANGED;
    }
    int64_t adopted = RQ(int64_t, RQ_ADOPTED)[r];
    if (adopted) {
        PyObject *held = PyDict_GetItemWithError(s->tenants, name); /* borrowed */
        if (held == NULL && PyErr_Occurred()) return -1;
        int other = 0;
        if (held != NULL && PySet_GET_SIZE(held) > 0) {
            if (PySet_GET_SIZE(held) > 1) {
                other = 1;
            } else {
                int has = PySet_Contains(held, PyList_GET_ITEM(s->ctenant, tenant[l]));
                if (has < 0) return -1;
                other = !has;
            }
        }
        if (other && cross_tenant(s, l, adopted)) o[O_FLAGS] |= F_CROSS;
    }
    return 0;
}

/* tenant_of(table, key): the tenant id of the object's last commit (0: none), or None: no object. */
static PyObject *State_tenant_of(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(2, "tenant_of");
    uint64_t key;
    uint32_t table = (uint32_t)PyLong_AsUnsignedLong(args[0]);
    if (u64(args[1], &key) < 0 || PyErr_Occurred()) return NULL;
    const Obj *o = find(s, table, key);
    if (o == NULL) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(o->has_commit ? o->tenant : 0);
}

static PyObject *State_count(State *s, PyObject *unused) { return PyLong_FromSize_t(s->tcount); }

/* export() -> ([(table, key, ((tier, committed, nbytes, checksum, ord), ...), has_commit, identity,
 *               tenant, adapter, commit_checksum, commit_nbytes, lease, inv_ord, inv_reason)],
 *              [(instance, tier, tenant, adapter, ord, reason)]) */
/* export(with_objects=True): the objects as tuples (unless told not) and the bulk scopes. */
static PyObject *State_export(State *s, PyObject *const *args, Py_ssize_t nargs) {
    int with_objects = nargs < 1 ? 1 : PyObject_IsTrue(args[0]);
    if (with_objects < 0) return NULL;
    PyObject *objs = PyList_New(0), *scopes = PyList_New(0);
    if (!objs || !scopes) goto fail;
    for (size_t j = 0; with_objects && j < s->tcap; j++) {
        if (s->tab[j].idx == EMPTY) continue;
        const Obj *o = &s->objs[s->tab[j].idx];
        int n = 0;
        for (int t = 0; t < NTIERS; t++) n += !!(o->mask & (1u << t));
        PyObject *copies = PyTuple_New(n);
        if (!copies) goto fail;
        for (int t = 0, k = 0; t < NTIERS; t++) {
            if (!(o->mask & (1u << t))) continue;
            const Copy *c = &o->copies[t];
            PyTuple_SET_ITEM(copies, k++, Py_BuildValue("(iiKKL)", t, (int)c->committed,
                                                        (unsigned long long)c->nbytes,
                                                        (unsigned long long)c->checksum, (long long)c->ord));
        }
        PyObject *row = Py_BuildValue("(IKNiIIIKKLLi)", o->table, (unsigned long long)o->key, copies,
                                      (int)o->has_commit, o->identity, o->tenant, o->adapter,
                                      (unsigned long long)o->commit_checksum, (unsigned long long)o->commit_nbytes,
                                      (long long)o->lease, (long long)o->inv_ord, (int)o->inv_reason);
        if (!row || PyList_Append(objs, row) < 0) {
            Py_XDECREF(row);
            goto fail;
        }
        Py_DECREF(row);
    }
    for (uint32_t i = 0; i < s->nbulk; i++) {
        for (uint32_t k = 0; k < s->bulk[i].n; k++) {
            const Scope *x = &s->bulk[i].s[k];
            PyObject *row = Py_BuildValue("(IiIILi)", i, (int)x->tier, x->tenant, x->adapter, (long long)x->ord,
                                          (int)x->reason);
            if (!row || PyList_Append(scopes, row) < 0) {
                Py_XDECREF(row);
                goto fail;
            }
            Py_DECREF(row);
        }
    }
    return Py_BuildValue("(NN)", objs, scopes);
fail:
    Py_XDECREF(objs);
    Py_XDECREF(scopes);
    return NULL;
}

/* The snapshot's form of the objects (analysis.packed.RECORD): one fixed record per object,
 * little-endian, no padding, ids of the wrapper's interning lists. Why: building a Python
 * object per live object and a msgpack map per copy cost ~1 s a side for 300k objects; this is
 * a copy. The hosts this builds on are little-endian (the module refuses to load elsewhere). */
#define REC_SIZE (56 + NTIERS * 25)

static inline void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline uint64_t get64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t get32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static PyObject *State_pack(State *s, PyObject *unused) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(s->tcount * REC_SIZE));
    if (!out) return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    memset(p, 0, s->tcount * REC_SIZE);
    for (size_t j = 0; j < s->tcap; j++) {
        if (s->tab[j].idx == EMPTY) continue;
        const Obj *o = &s->objs[s->tab[j].idx];
        put64(p, o->key);
        put32(p + 8, o->table);
        put32(p + 12, o->identity);
        put32(p + 16, o->tenant);
        p[20] = o->mask;
        p[21] = o->has_commit;
        p[22] = o->inv_reason;
        put64(p + 24, o->commit_checksum);
        put64(p + 32, o->commit_nbytes);
        put64(p + 40, (uint64_t)o->lease);
        put64(p + 48, (uint64_t)o->inv_ord);
        for (int t = 0; t < NTIERS; t++) {
            if (!(o->mask & (1u << t))) continue;
            const Copy *c = &o->copies[t];
            put64(p + 56 + 8 * t, c->nbytes);
            put64(p + 56 + 8 * NTIERS + 8 * t, c->checksum);
            put64(p + 56 + 16 * NTIERS + 8 * t, (uint64_t)(int64_t)c->ord);
            p[56 + 24 * NTIERS + t] = (unsigned char)c->committed;
        }
        p += REC_SIZE;
    }
    return out;
}

/* unpack(records, ntables, nstrings): the objects of `pack`, their ids already this state's. */
static PyObject *State_unpack(State *s, PyObject *const *args, Py_ssize_t nargs) {
    NEED(3, "unpack");
    if (s->kinds == NULL) return PyErr_Format(PyExc_RuntimeError, "unpack before bind");
    uint32_t ntables = (uint32_t)PyLong_AsUnsignedLong(args[1]), nstrings = (uint32_t)PyLong_AsUnsignedLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    if (view.len % REC_SIZE) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "packed objects: %zd bytes is not a whole number of records", view.len);
    }
    const unsigned char *p = (const unsigned char *)view.buf, *end = p + view.len;
    for (; p < end; p += REC_SIZE) {
        uint64_t key = get64(p);
        uint32_t table = get32(p + 8), identity = get32(p + 12), tenant = get32(p + 16);
        uint8_t mask = p[20], has_commit = p[21], reason = p[22];
        if (table >= ntables || tenant >= nstrings || (has_commit && identity >= s->nident) || has_commit > 1 ||
            mask >= (1u << NTIERS) || reason >= (uint8_t)PyDict_Size(s->reasons)) {
            PyBuffer_Release(&view);
            return PyErr_Format(PyExc_ValueError, "packed objects: a record names an id or code out of range");
        }
        if (find(s, table, key) != NULL) {
            PyBuffer_Release(&view);
            return PyErr_Format(PyExc_ValueError, "packed objects: an object loaded twice");
        }
        Obj *o = born(s, table, key);
        if (o == NULL) {
            PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
        o->mask = mask;
        o->has_commit = has_commit;
        o->inv_reason = reason;
        if (has_commit) {
            o->identity = identity;
            o->tenant = tenant;
            o->adapter = s->idents[identity].f[2];
        }
        o->commit_checksum = get64(p + 24);
        o->commit_nbytes = get64(p + 32);
        o->lease = (int64_t)get64(p + 40);
        o->inv_ord = (int64_t)get64(p + 48);
        for (int t = 0; t < NTIERS; t++) {
            if (!(mask & (1u << t))) continue;
            o->copies[t] = (Copy){get64(p + 56 + 8 * t), get64(p + 56 + 8 * NTIERS + 8 * t),
                                  (int64_t)get64(p + 56 + 16 * NTIERS + 8 * t), (uint64_t)(p[56 + 24 * NTIERS + t] != 0)};
        }
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static void State_dealloc(State *s) {
    release_columns(s);
    PyMem_RawFree(s->tab);
    PyMem_RawFree(s->objs_mem);
    PyMem_RawFree(s->freel);
    for (uint32_t i = 0; i < s->nbulk; i++) PyMem_RawFree(s->bulk[i].s);
    PyMem_RawFree(s->bulk);
    PyMem_RawFree(s->idents);
    PyMem_RawFree(s->shared);
    PyMem_RawFree(s->checks);
    PyMem_RawFree(s->sums);
    PyMem_RawFree(s->keys);
    Py_XDECREF(s->kinds);
    Py_XDECREF(s->tiers);
    Py_XDECREF(s->reasons);
    Py_XDECREF(s->strings);
    Py_XDECREF(s->string_list);
    Py_XDECREF(s->tables);
    Py_XDECREF(s->table_list);
    Py_XDECREF(s->instances);
    Py_XDECREF(s->instance_list);
    Py_XDECREF(s->identities);
    Py_XDECREF(s->identity_list);
    Py_XDECREF(s->changes);
    Py_XDECREF(s->leased);
    Py_XDECREF(s->tenants);
    Py_XDECREF(s->born);
    Py_XDECREF(s->died);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* State(rollback_reason, shared_tenant_ids) */
static int State_init(State *s, PyObject *args, PyObject *kw) {
    int rollback;
    PyObject *shared;
    if (!PyArg_ParseTuple(args, "iO!", &rollback, &PyTuple_Type, &shared)) return -1;
    s->rollback = (uint8_t)rollback;
    Py_ssize_t n = PyTuple_GET_SIZE(shared);
    PyMem_RawFree(s->shared);
    s->shared = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (!s->shared) return -1;
    for (Py_ssize_t i = 0; i < n; i++) s->shared[i] = (uint32_t)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(shared, i));
    s->nshared = (uint32_t)n;
    return PyErr_Occurred() ? -1 : 0;
}

static PyMethodDef State_methods[] = {
    {"bulk", (PyCFunction)(void (*)(void))State_bulk, METH_FASTCALL, NULL},
    {"identity", (PyCFunction)(void (*)(void))State_identity, METH_FASTCALL, NULL},
    {"apply", (PyCFunction)(void (*)(void))State_apply, METH_FASTCALL, NULL},
    {"load_columns", (PyCFunction)(void (*)(void))State_load_columns, METH_FASTCALL, NULL},
    {"apply_rows", (PyCFunction)(void (*)(void))State_apply_rows, METH_FASTCALL, NULL},
    {"load_requests", (PyCFunction)(void (*)(void))State_load_requests, METH_FASTCALL, NULL},
    {"bind", (PyCFunction)(void (*)(void))State_bind, METH_FASTCALL, NULL},
    {"evaluate", (PyCFunction)(void (*)(void))State_evaluate, METH_FASTCALL, NULL},
    {"tenant_of", (PyCFunction)(void (*)(void))State_tenant_of, METH_FASTCALL, NULL},
    {"count", (PyCFunction)State_count, METH_NOARGS, NULL},
    {"track", (PyCFunction)State_track, METH_NOARGS, NULL},
    {"load_objects", (PyCFunction)(void (*)(void))State_load_objects, METH_FASTCALL, NULL},
    {"export", (PyCFunction)(void (*)(void))State_export, METH_FASTCALL, NULL},
    {"pack", (PyCFunction)State_pack, METH_NOARGS, NULL},
    {"unpack", (PyCFunction)(void (*)(void))State_unpack, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtrace.analysis._native.State",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)State_init,
    .tp_dealloc = (destructor)State_dealloc,
    .tp_methods = State_methods,
    .tp_doc = "Live cache objects and lookup evaluation (see analysis.native_state).",
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    const uint16_t endian = 1;
    if (*(const uint8_t *)&endian != 1) /* `pack` writes the host's order, read as little-endian */
        return PyErr_Format(PyExc_ImportError, "kvtrace's compiled state needs a little-endian host");
    if (PyType_Ready(&StateType) < 0) return NULL;
    static const char *identity[7] = {"model", "model_revision", "adapter", "transform", "kv_dtype", "layout", "epoch"};
    if (!(A_kind = PyUnicode_InternFromString("kind")) || !(A_instance = PyUnicode_InternFromString("instance")) ||
        !(A_group_id = PyUnicode_InternFromString("group_id")) ||
        !(A_block_key = PyUnicode_InternFromString("block_key")) ||
        !(A_more_keys = PyUnicode_InternFromString("more_keys")) || !(A_tier = PyUnicode_InternFromString("tier")) ||
        !(A_dst_tier = PyUnicode_InternFromString("dst_tier")) || !(A_nbytes = PyUnicode_InternFromString("nbytes")) ||
        !(A_checksum = PyUnicode_InternFromString("checksum")) ||
        !(A_lease = PyUnicode_InternFromString("lease_expiry_ns")) ||
        !(A_reason = PyUnicode_InternFromString("reason")) || !(A_tenant = PyUnicode_InternFromString("tenant")) ||
        !(A_adapter = PyUnicode_InternFromString("adapter")))
        return NULL;
    for (int i = 0; i < 7; i++)
        if (!(A_identity[i] = PyUnicode_InternFromString(identity[i]))) return NULL;
    if (!(A_copies = PyUnicode_InternFromString("copies")) || !(A_commit = PyUnicode_InternFromString("commit")) ||
        !(A_committed = PyUnicode_InternFromString("committed")) || !(A_ord = PyUnicode_InternFromString("ord")) ||
        !(A_identity_field = PyUnicode_InternFromString("identity")) ||
        !(A_invalidated_reason = PyUnicode_InternFromString("invalidated_reason")) ||
        !(A_lease_expiry = PyUnicode_InternFromString("lease_expiry_ns")) ||
        !(A_invalidated_ord = PyUnicode_InternFromString("invalidated_ord")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&StateType);
    if (PyModule_AddObject(m, "State", (PyObject *)&StateType) < 0) {
        Py_DECREF(&StateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
