/* .npy and safetensors: round trips through every dtype and layout, hand-made
 * files, hostile files, atomic writes, and a seeded mutation fuzz. */
#include "testutil.h"
#include "io/io.h"

#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

static char tdir[1024];

static void tpath(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", tdir, name); }

static int write_bytes(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return 0;
  size_t w = n ? fwrite(data, 1, n, f) : 0;
  return (fclose(f) == 0) & (w == n);
}

static unsigned char *read_bytes(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 4096, len = 0;
  unsigned char *b = malloc(cap);
  for (;;) {
    if (len == cap) b = realloc(b, cap *= 2);
    size_t r = fread(b + len, 1, cap - len, f);
    if (!r) break;
    len += r;
  }
  fclose(f);
  *n = len;
  return b;
}

static int exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

/* Temporaries a failed write might have left behind. */
static int leftovers(void) {
  DIR *d = opendir(tdir);
  int n = 0;
  if (!d) return -1;
  for (struct dirent *e; (e = readdir(d));) n += strstr(e->d_name, ".tmp.") != NULL;
  closedir(d);
  return n;
}

static void cleanup_dir(void) {
  DIR *d = opendir(tdir);
  if (!d) return;
  char p[2048];
  for (struct dirent *e; (e = readdir(d));) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(p, sizeof p, "%s/%s", tdir, e->d_name);
    if (unlink(p) != 0) rmdir(p);
  }
  closedir(d);
  rmdir(tdir);
}

/* A failure must carry the expected status and a message. */
#define CHECK_FAIL(ctx, call, want)                                                                  \
  do {                                                                                               \
    attn_status st_ = (call);                                                                        \
    CHECK(st_ == (want), "%s -> %s (%s), want %s", #call, attn_strerror(st_), attn_ctx_error(ctx), \
          attn_strerror(want));                                                                      \
    CHECK(st_ == ATTN_OK || attn_ctx_error(ctx)[0], "%s: empty message", #call);                    \
  } while (0)

/* ---- strided sources ------------------------------------------------------------ */
static int64_t elem_off(const attn_tensor *t, int64_t lin) {
  int64_t off = 0;
  for (int d = t->rank - 1; d >= 0; d--) {
    int64_t i = lin % t->shape[d];
    lin /= t->shape[d];
    off += i * t->strides[d];
  }
  return off;
}

/* Does contiguous c hold exactly the elements of strided t, byte for byte? */
static int same_elements(const attn_tensor *t, const attn_tensor *c) {
  if (t->dtype != c->dtype || t->rank != c->rank) return 0;
  for (int i = 0; i < t->rank; i++)
    if (t->shape[i] != c->shape[i]) return 0;
  int64_t n = attn_tensor_numel(t);
  size_t es = attn_dtype_size(t->dtype);
  for (int64_t i = 0; i < n; i++)
    if (memcmp((const unsigned char *)t->data + elem_off(t, i) * (int64_t)es,
               (const unsigned char *)c->data + i * (int64_t)es, es))
      return 0;
  return 1;
}

enum { V_CONTIG, V_PERMUTED, V_STEP2, V_BROADCAST, V_REVERSED, V_COUNT };
static const char *vname[V_COUNT] = {"contiguous", "permuted", "step2", "broadcast", "reversed"};

/* A view of shape `shape` laid out as `variant` over a fresh random buffer (*base). */
static attn_tensor make_source(tu_rng *r, attn_dtype dt, int rank, const int64_t *shape, int variant,
                               unsigned char **base) {
  size_t es = attn_dtype_size(dt);
  int64_t bshape[ATTN_MAX_RANK], n = 1;
  for (int i = 0; i < rank; i++) {
    bshape[i] = shape[i];
    if (variant == V_PERMUTED) bshape[i] = shape[rank - 1 - i];
    if (variant == V_STEP2) bshape[i] = 2 * shape[i];
  }
  int brank = rank;
  const int64_t *bs = bshape;
  if (variant == V_BROADCAST && rank > 0) {
    brank = rank - 1;
    bs = bshape + 1;
  }
  for (int i = 0; i < brank; i++) n *= bs[i];
  *base = malloc((size_t)(n ? n : 1) * es);
  for (int64_t i = 0; i < n * (int64_t)es; i++) (*base)[i] = (unsigned char)tu_next(r);
  if (dt == ATTN_BOOL)
    for (int64_t i = 0; i < n; i++) (*base)[i] &= 1;
  attn_tensor b = attn_tensor_view(*base, dt, brank, bs), v = b;
  int perm[ATTN_MAX_RANK];
  switch (variant) {
    case V_PERMUTED:
      for (int i = 0; i < rank; i++) perm[i] = rank - 1 - i;
      attn_tensor_permute(&v, &b, perm);
      break;
    case V_STEP2:
      for (int i = 0; i < rank; i++) {
        v.shape[i] = shape[i];
        v.strides[i] = b.strides[i] * 2;
      }
      break;
    case V_BROADCAST:
      if (rank == 0) break;
      v.rank = rank;
      v.shape[0] = shape[0];
      v.strides[0] = 0;
      for (int i = 1; i < rank; i++) {
        v.shape[i] = shape[i];
        v.strides[i] = b.strides[i - 1];
      }
      break;
    case V_REVERSED:
      if (rank == 0 || shape[rank - 1] == 0) break;
      v.data = *base + (shape[rank - 1] - 1) * (int64_t)es;
      v.strides[rank - 1] = -1;
      break;
    default: break;
  }
  return v;
}

static void test_roundtrip(attn_ctx *ctx) {
  tu_rng r = {42};
  const attn_dtype dts[] = {ATTN_F32, ATTN_F64, ATTN_F16, ATTN_BF16, ATTN_BOOL, ATTN_U8};
  char np[1100], sp[1100];
  tpath(np, sizeof np, "rt.npy");
  tpath(sp, sizeof sp, "rt.safetensors");
  for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++)
    for (int rank = 0; rank <= 4; rank++)
      for (int var = 0; var < V_COUNT; var++)
        for (int zero = 0; zero < (rank ? 2 : 1); zero++) {
          attn_dtype dt = dts[di];
          int64_t shape[ATTN_MAX_RANK];
          for (int i = 0; i < rank; i++) shape[i] = tu_int(&r, 1, 4);
          if (zero) shape[tu_int(&r, 0, rank - 1)] = 0;
          unsigned char *base;
          attn_tensor src = make_source(&r, dt, rank, shape, var, &base);
          const char *what = vname[var];

          unlink(np);
          attn_status st = attn_npy_write(ctx, np, &src);
          if (dt == ATTN_BF16) {
            CHECK(st == ATTN_E_DTYPE && attn_ctx_error(ctx)[0], "bf16 npy write -> %s", attn_strerror(st));
            CHECK(!exists(np), "a failed npy write left a file");
          } else {
            CHECK(st == ATTN_OK, "npy write %s rank %d %s: %s", attn_dtype_name(dt), rank, what, attn_ctx_error(ctx));
            attn_tensor got;
            st = attn_npy_read(ctx, &got, np);
            CHECK(st == ATTN_OK, "npy read %s rank %d %s: %s", attn_dtype_name(dt), rank, what, attn_ctx_error(ctx));
            if (st == ATTN_OK) {
              CHECK(same_elements(&src, &got), "npy round trip differs: %s rank %d %s", attn_dtype_name(dt), rank,
                    what);
              CHECK(((uintptr_t)got.data & 63) == 0, "npy data not 64-byte aligned");
              attn_tensor_free(&got);
            }
            /* npy layout: the data starts at a multiple of 64, after a '\n'. */
            size_t n;
            unsigned char *bytes = read_bytes(np, &n);
            CHECK(bytes && n >= 10, "cannot reread %s", np);
            if (bytes && n >= 10) {
              size_t hl = (size_t)bytes[8] | (size_t)bytes[9] << 8, off = 10 + hl;
              CHECK(bytes[6] == 1 && off % 64 == 0 && off <= n && bytes[off - 1] == '\n', "npy header layout");
            }
            free(bytes);
          }

          const char *name = "t";
          CHECK_OK(ctx, attn_safetensors_write(ctx, sp, 1, &name, &src));
          attn_safetensors *sf = NULL;
          st = attn_safetensors_open(ctx, &sf, sp);
          CHECK(st == ATTN_OK, "safetensors open %s rank %d %s: %s", attn_dtype_name(dt), rank, what,
                attn_ctx_error(ctx));
          if (st == ATTN_OK) {
            attn_tensor got;
            CHECK(attn_safetensors_count(sf) == 1, "count");
            CHECK_OK(ctx, attn_safetensors_get(ctx, &got, sf, "t"));
            CHECK(same_elements(&src, &got), "safetensors round trip differs: %s rank %d %s", attn_dtype_name(dt),
                  rank, what);
            attn_safetensors_close(sf);
          }
          free(base);
        }
  CHECK(leftovers() == 0, "temporary files left behind");

  /* Many tensors in one file, odd sizes so later ones land misaligned. */
  enum { NT = 7 };
  const char *names[NT] = {"u8.odd", "f32", "layer.0.\"quoted\"\\", "caf\xc3\xa9 \xf0\x9f\x98\x80", "bf16", "f64\n",
                           "bool"};
  attn_dtype tds[NT] = {ATTN_U8, ATTN_F32, ATTN_F16, ATTN_F32, ATTN_BF16, ATTN_F64, ATTN_BOOL};
  attn_tensor ts[NT];
  unsigned char *bases[NT];
  for (int i = 0; i < NT; i++) {
    int64_t sh[2] = {i == 0 ? 3 : 2, 3};
    ts[i] = make_source(&r, tds[i], 2, sh, i % V_COUNT, &bases[i]);
  }
  CHECK_OK(ctx, attn_safetensors_write(ctx, sp, NT, names, ts));
  attn_safetensors *sf = NULL;
  CHECK_OK(ctx, attn_safetensors_open(ctx, &sf, sp));
  if (sf) {
    CHECK(attn_safetensors_count(sf) == NT, "count %lld", (long long)attn_safetensors_count(sf));
    for (int i = 0; i < NT; i++) {
      const char *nm = attn_safetensors_name(sf, i);
      CHECK(nm && !strcmp(nm, names[i]), "name %d in file order", i);
      attn_tensor got;
      CHECK_OK(ctx, attn_safetensors_get(ctx, &got, sf, names[i]));
      CHECK(same_elements(&ts[i], &got), "tensor %d differs", i);
      CHECK(((uintptr_t)got.data % attn_dtype_size(got.dtype)) == 0, "tensor %d misaligned", i);
    }
    CHECK(attn_safetensors_name(sf, NT) == NULL && attn_safetensors_name(sf, -1) == NULL, "name out of range");
    attn_tensor got;
    CHECK_FAIL(ctx, attn_safetensors_get(ctx, &got, sf, "absent"), ATTN_E_NOT_FOUND);
    attn_safetensors_close(sf);
  }
  /* Header length padded to a multiple of 8, as the reference writer does. */
  size_t n;
  unsigned char *bytes = read_bytes(sp, &n);
  if (bytes && n >= 8) {
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | bytes[i];
    CHECK(hl % 8 == 0 && hl + 8 <= n, "safetensors header length %llu", (unsigned long long)hl);
  }
  free(bytes);
  for (int i = 0; i < NT; i++) free(bases[i]);

  /* Zero tensors is a valid file. */
  CHECK_OK(ctx, attn_safetensors_write(ctx, sp, 0, NULL, NULL));
  CHECK_OK(ctx, attn_safetensors_open(ctx, &sf, sp));
  CHECK(attn_safetensors_count(sf) == 0, "empty file count");
  attn_safetensors_close(sf);
}

/* ---- hand-made files -------------------------------------------------------------- */
/* magic, version, length, dict (padded to 64 with '\n' if pad), data. */
static size_t make_npy(unsigned char *buf, int major, const char *dict, int pad, const void *data, size_t ndata) {
  size_t prefix = major == 1 ? 10 : 12, dl = strlen(dict), hl = dl;
  if (pad) hl = (prefix + dl + 1 + 63) / 64 * 64 - prefix;
  memcpy(buf, "\x93NUMPY", 6);
  buf[6] = (unsigned char)major;
  buf[7] = 0;
  for (size_t i = 0; i < prefix - 8; i++) buf[8 + i] = (unsigned char)(hl >> (8 * i));
  memcpy(buf + prefix, dict, dl);
  if (pad) {
    memset(buf + prefix + dl, ' ', hl - dl - 1);
    buf[prefix + hl - 1] = '\n';
  }
  if (ndata) memcpy(buf + prefix + hl, data, ndata);
  return prefix + hl + ndata;
}

static attn_status npy_from_bytes(attn_ctx *ctx, const void *bytes, size_t n, attn_tensor *out) {
  char p[1100];
  tpath(p, sizeof p, "hand.npy");
  if (!write_bytes(p, bytes, n)) return ATTN_E_IO;
  memset(out, 0, sizeof *out);
  return attn_npy_read(ctx, out, p);
}

/* A hostile npy must fail with want; a message; no tensor handed back. */
static void npy_bad(attn_ctx *ctx, const void *bytes, size_t n, attn_status want, const char *needle, int line) {
  attn_tensor t;
  attn_status st = npy_from_bytes(ctx, bytes, n, &t);
  CHECK(st == want, "line %d: got %s (%s), want %s", line, attn_strerror(st), attn_ctx_error(ctx), attn_strerror(want));
  CHECK(st == ATTN_OK || attn_ctx_error(ctx)[0], "line %d: empty message", line);
  CHECK(!needle || strstr(attn_ctx_error(ctx), needle), "line %d: message '%s' lacks '%s'", line, attn_ctx_error(ctx),
        needle);
  if (st == ATTN_OK) attn_tensor_free(&t);
  else CHECK(t.data == NULL, "line %d: data handed back on failure", line);
}

static void npy_bad_dict(attn_ctx *ctx, const char *dict, const void *data, size_t nd, attn_status want,
                         const char *needle, int line) {
  unsigned char buf[4096];
  size_t n = make_npy(buf, 1, dict, 1, data, nd);
  npy_bad(ctx, buf, n, want, needle, line);
}

static void test_npy_handmade(attn_ctx *ctx) {
  unsigned char buf[8192];
  float f6[6] = {1, 2, 3, 4, 5, 6};
  double d3[3] = {0.5, -1.25, 1e300};
  attn_tensor t;
  size_t n;

  struct {
    int major, pad;
    const char *dict;
  } good[] = {
      {1, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"},
      {1, 1, "{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}"},
      {1, 0, "{'fortran_order':False,'descr':'<f4','shape':(2,3)}"},
      {2, 1, "{ 'descr' :  '<f4' ,\t'shape' : ( 2 , 3 , ) ,\n 'fortran_order' : False , }"},
      {3, 1, "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2L, 3L)}"},
      {1, 1, "{'descr': '=f4', 'fortran_order': False, 'shape': (6,), }"},
  };
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    n = make_npy(buf, good[i].major, good[i].dict, good[i].pad, f6, sizeof f6);
    attn_status st = npy_from_bytes(ctx, buf, n, &t);
    CHECK(st == ATTN_OK, "good header %zu: %s", i, attn_ctx_error(ctx));
    if (st) continue;
    CHECK(t.dtype == ATTN_F32 && attn_tensor_numel(&t) == 6, "good header %zu: dtype/numel", i);
    CHECK(i == 5 ? (t.rank == 1 && t.shape[0] == 6) : (t.rank == 2 && t.shape[0] == 2 && t.shape[1] == 3),
          "good header %zu: shape", i);
    CHECK(!memcmp(t.data, f6, sizeof f6), "good header %zu: data", i);
    attn_tensor_free(&t);
  }
  /* Byte for byte what numpy 2.x writes for np.save(f, np.array([1.0, -2.0], '<f4')). */
  static const char numpy_bytes[] = "\x93NUMPY\x01\x00\x76\x00"
                                    "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"
                                    "          " "          " "          " "          " "          " "          "
                                    "\n"
                                    "\x00\x00\x80\x3f\x00\x00\x00\xc0";
  CHECK(sizeof numpy_bytes - 1 == 136, "literal length %zu", sizeof numpy_bytes - 1);
  CHECK_OK(ctx, npy_from_bytes(ctx, numpy_bytes, sizeof numpy_bytes - 1, &t));
  CHECK(t.dtype == ATTN_F32 && t.rank == 1 && t.shape[0] == 2 && ((float *)t.data)[0] == 1 &&
            ((float *)t.data)[1] == -2,
        "numpy's own file");
  attn_tensor_free(&t);
  /* Scalars, f64, f16, u8, bool; trailing bytes after the data are ignored. */
  n = make_npy(buf, 1, "{'descr': '<f8', 'fortran_order': False, 'shape': (), }", 1, d3, sizeof d3);
  CHECK_OK(ctx, npy_from_bytes(ctx, buf, n, &t));
  CHECK(t.rank == 0 && t.dtype == ATTN_F64 && ((double *)t.data)[0] == 0.5, "scalar f64");
  attn_tensor_free(&t);
  uint16_t h[2] = {0x3c00, 0xc000}; /* 1.0, -2.0 */
  n = make_npy(buf, 1, "{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }", 1, h, sizeof h);
  CHECK_OK(ctx, npy_from_bytes(ctx, buf, n, &t));
  CHECK(t.dtype == ATTN_F16 && ((uint16_t *)t.data)[1] == 0xc000, "f16");
  attn_tensor_free(&t);
  const unsigned char u[4] = {0, 1, 200, 255};
  const char *u8d[] = {"{'descr': '|u1', 'fortran_order': False, 'shape': (4,), }",
                       "{'descr': '<u1', 'fortran_order': False, 'shape': (4,), }",
                       "{'descr': '|b1', 'fortran_order': False, 'shape': (2, 2), }",
                       "{'descr': '>b1', 'fortran_order': False, 'shape': (4,), }"};
  for (int i = 0; i < 4; i++) {
    n = make_npy(buf, 1, u8d[i], 1, u, 4);
    CHECK_OK(ctx, npy_from_bytes(ctx, buf, n, &t));
    CHECK(t.dtype == (i >= 2 ? ATTN_BOOL : ATTN_U8) && !memcmp(t.data, u, 4), "byte dtype %d", i);
    attn_tensor_free(&t);
  }
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 5), }", 1, NULL, 0);
  CHECK_OK(ctx, npy_from_bytes(ctx, buf, n, &t));
  CHECK(t.rank == 2 && t.shape[0] == 0 && t.shape[1] == 5, "empty");
  attn_tensor_free(&t);
  /* Empty, its strides just inside int64: 2 x (2^62 - 1) bytes. */
  n = make_npy(buf, 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (0, 4611686018427387903, 2), }", 1, NULL, 0);
  CHECK_OK(ctx, npy_from_bytes(ctx, buf, n, &t));
  CHECK(t.rank == 3 && attn_tensor_numel(&t) == 0 && t.strides[0] == INT64_MAX - 1 && t.strides[1] == 2,
        "empty beside a huge dimension: strides %lld %lld", (long long)t.strides[0], (long long)t.strides[1]);
  attn_tensor_free(&t);

  /* Hostile files. */
  npy_bad(ctx, "", 0, ATTN_E_FORMAT, "hand.npy", __LINE__);
  npy_bad(ctx, "\x93NUM", 4, ATTN_E_FORMAT, "magic", __LINE__);
  npy_bad(ctx, "\x93NUMPX\x01\x00\x10\x00", 10, ATTN_E_FORMAT, "magic", __LINE__);
  npy_bad(ctx, "PK\x03\x04garbage garbage", 18, ATTN_E_FORMAT, NULL, __LINE__);
  npy_bad(ctx, "\x93NUMPY\x01", 7, ATTN_E_FORMAT, NULL, __LINE__);
  npy_bad(ctx, "\x93NUMPY\x01\x00", 8, ATTN_E_FORMAT, NULL, __LINE__);
  npy_bad(ctx, "\x93NUMPY\x01\x00\x46", 9, ATTN_E_FORMAT, NULL, __LINE__);
  npy_bad(ctx, "\x93NUMPY\x02\x00\x46\x00\x00", 11, ATTN_E_FORMAT, NULL, __LINE__);
  npy_bad(ctx, "\x93NUMPY\x04\x00\x10\x00{}", 12, ATTN_E_UNSUPPORTED, "version", __LINE__);
  npy_bad(ctx, "\x93NUMPY\x01\x01\x10\x00{}", 12, ATTN_E_UNSUPPORTED, "version", __LINE__);
  /* Header length beyond the file, and beyond the cap. */
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 1, f6, sizeof f6);
  npy_bad(ctx, buf, 70, ATTN_E_FORMAT, "truncated", __LINE__); /* header cut short */
  buf[8] = 0xff;
  buf[9] = 0xff;
  npy_bad(ctx, buf, n, ATTN_E_FORMAT, "truncated", __LINE__);
  n = make_npy(buf, 2, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 1, f6, sizeof f6);
  memcpy(buf + 8, "\x00\x00\x10\x00", 4); /* 1 MiB */
  npy_bad(ctx, buf, n, ATTN_E_FORMAT, "limit", __LINE__);
  buf[10] = 0xff;
  buf[11] = 0xff;
  npy_bad(ctx, buf, n, ATTN_E_FORMAT, "limit", __LINE__);
  /* Data one byte short. */
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 1, f6, sizeof f6);
  npy_bad(ctx, buf, n - 1, ATTN_E_FORMAT, "truncated", __LINE__);
  npy_bad(ctx, buf, n - sizeof f6, ATTN_E_FORMAT, "truncated", __LINE__);

#define BAD(dict, want, needle) npy_bad_dict(ctx, dict, f6, sizeof f6, want, needle, __LINE__)
  BAD("{'descr': '<f4', 'fortran_order': False}", ATTN_E_FORMAT, "shape");
  BAD("{'descr': '<f4', 'shape': (2, 3)}", ATTN_E_FORMAT, "fortran_order");
  BAD("{'fortran_order': False, 'shape': (2, 3)}", ATTN_E_FORMAT, "descr");
  BAD("{}", ATTN_E_FORMAT, NULL);
  BAD("", ATTN_E_FORMAT, NULL);
  BAD("not a dict at all", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<u4', 'fortran_order': False, 'shape': (6,)}", ATTN_E_DTYPE, "<u4");
  {
    const int64_t huge[3] = {1, ((int64_t)1 << 53) + 1, 2};
    npy_bad_dict(ctx, "{'descr': '<i8', 'fortran_order': False, 'shape': (3,)}", huge, sizeof huge, ATTN_E_DTYPE,
                 "2^53", __LINE__);
    /* integers are read as exact doubles, whatever their width */
    const int32_t i4[5] = {0, -7, 2147483647, -2147483647 - 1, 12345};
    const int64_t i8[5] = {0, -7, (int64_t)1 << 53, -((int64_t)1 << 53), 4000000000LL};
    for (int w = 0; w < 2; w++) {
      n = make_npy(buf, 1, w ? "{'descr': '<i8', 'fortran_order': False, 'shape': (5,)}"
                             : "{'descr': '<i4', 'fortran_order': False, 'shape': (5,)}",
                   1, w ? (const void *)i8 : (const void *)i4, w ? sizeof i8 : sizeof i4);
      CHECK_OK(ctx, attn__npy_read_mem(ctx, &t, buf, n, "ints.npy"));
      CHECK(t.dtype == ATTN_F64 && t.rank == 1 && t.shape[0] == 5, "integers come back as f64 [5]");
      for (int i = 0; i < 5 && t.dtype == ATTN_F64; i++)
        CHECK(((double *)t.data)[i] == (w ? (double)i8[i] : (double)i4[i]), "integer %d of width %d read exactly", i,
              w ? 8 : 4);
      attn_tensor_free(&t);
    }
    n = make_npy(buf, 1, "{'descr': '<i4', 'fortran_order': False, 'shape': (6,)}", 1, i4, sizeof i4);
    npy_bad(ctx, buf, n, ATTN_E_FORMAT, "truncated", __LINE__);
  }
  BAD("{'descr': '<U10', 'fortran_order': False, 'shape': (1,)}", ATTN_E_DTYPE, NULL);
  BAD("{'descr': 'f4', 'fortran_order': False, 'shape': (6,)}", ATTN_E_DTYPE, NULL);
  BAD("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,)}", ATTN_E_DTYPE, NULL);
  BAD("{'descr': '>f4', 'fortran_order': True, 'shape': (2, 4)}", ATTN_E_FORMAT, "truncated"); /* 6 of 8 */
  BAD("{'descr': '<f4', 'fortran_order': 1, 'shape': (2, 3)}", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': Falsey, 'shape': (2, 3)}", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (-1, 3)}", ATTN_E_FORMAT, "negative");
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3)}", ATTN_E_FORMAT, "negative");
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000, 100000000000)}", ATTN_E_FORMAT, "large");
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000,)}", ATTN_E_FORMAT, "truncated");
  BAD("{'descr': '<f8', 'fortran_order': False, 'shape': (1152921504606846976,)}", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,)}", ATTN_E_FORMAT, "large");
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,6)}", ATTN_E_UNSUPPORTED, "rank");
  /* No element, but strides past int64: 2^62 x 4 elements of 4 bytes beside the 0. */
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4611686018427387904, 4)}", ATTN_E_FORMAT, "large");
  BAD("{'descr': '|u1', 'fortran_order': False, 'shape': (4611686018427387904, 2, 0)}", ATTN_E_FORMAT, "large");
  BAD("{'descr': '<f8', 'fortran_order': False, 'shape': (3, 0, 1152921504606846976)}", ATTN_E_FORMAT, "large");
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': [2, 3]}", ATTN_E_FORMAT, "tuple");
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (2.0, 3)}", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (,)}", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (2 3)}", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)} junk", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3),, }", ATTN_E_FORMAT, NULL);
  BAD("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'extra': 1}", ATTN_E_FORMAT, "extra");
  BAD("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)}", ATTN_E_FORMAT, "repeat");
  BAD("{'descr': '<f4, 'fortran_order': False, 'shape': (2, 3)}", ATTN_E_FORMAT, NULL);
  BAD("{'descr: '<f4'", ATTN_E_FORMAT, NULL);
  BAD("{descr: '<f4', 'fortran_order': False, 'shape': (2, 3)}", ATTN_E_FORMAT, NULL);
#undef BAD
  /* NULs and high bytes inside the header. */
  n = make_npy(buf, 1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 1, f6, sizeof f6);
  buf[12] = 0;
  npy_bad(ctx, buf, n, ATTN_E_FORMAT, NULL, __LINE__);
  buf[12] = 0xff;
  npy_bad(ctx, buf, n, ATTN_E_FORMAT, NULL, __LINE__);

  /* Not there, or not a file: ATTN_E_IO naming the path and the reason. */
  char p[1100];
  tpath(p, sizeof p, "does_not_exist.npy");
  CHECK_FAIL(ctx, attn_npy_read(ctx, &t, p), ATTN_E_IO);
  CHECK(strstr(attn_ctx_error(ctx), p) && strstr(attn_ctx_error(ctx), strerror(ENOENT)), "io message: %s",
        attn_ctx_error(ctx));
  CHECK_FAIL(ctx, attn_npy_read(ctx, &t, tdir), ATTN_E_IO);
  CHECK_FAIL(ctx, attn_npy_read(ctx, NULL, p), ATTN_E_INVALID);
  CHECK_FAIL(ctx, attn_npy_read(ctx, &t, NULL), ATTN_E_INVALID);
}

/* ---- safetensors, hand-made ------------------------------------------------------- */
static size_t make_st(unsigned char *buf, const char *json, const void *data, size_t nd) {
  size_t hl = strlen(json);
  for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)hl >> (8 * i));
  memcpy(buf + 8, json, hl);
  if (nd) memcpy(buf + 8 + hl, data, nd);
  return 8 + hl + nd;
}

static attn_status st_from_bytes(attn_ctx *ctx, const void *bytes, size_t n, attn_safetensors **out) {
  char p[1100];
  tpath(p, sizeof p, "hand.safetensors");
  if (!write_bytes(p, bytes, n)) return ATTN_E_IO;
  return attn_safetensors_open(ctx, out, p);
}

static void st_bad_bytes(attn_ctx *ctx, const void *bytes, size_t n, attn_status want, const char *needle, int line) {
  attn_safetensors *s = (attn_safetensors *)&s; /* must be reset to NULL */
  attn_status st = st_from_bytes(ctx, bytes, n, &s);
  CHECK(st == want, "line %d: got %s (%s), want %s", line, attn_strerror(st), attn_ctx_error(ctx), attn_strerror(want));
  CHECK(st == ATTN_OK || attn_ctx_error(ctx)[0], "line %d: empty message", line);
  CHECK(!needle || strstr(attn_ctx_error(ctx), needle), "line %d: message '%s' lacks '%s'", line, attn_ctx_error(ctx),
        needle);
  if (st == ATTN_OK) attn_safetensors_close(s);
  else CHECK(s == NULL, "line %d: handle not NULL on failure", line);
}

static void st_bad(attn_ctx *ctx, const char *json, size_t nd, attn_status want, const char *needle, int line) {
  static unsigned char buf[1 << 14];
  unsigned char data[64] = {0};
  size_t n = make_st(buf, json, data, nd);
  st_bad_bytes(ctx, buf, n, want, needle, line);
}

static void test_st_handmade(attn_ctx *ctx) {
  static unsigned char buf[1 << 14];
  attn_safetensors *s = NULL;
  attn_tensor t;
  float f2[2] = {1.5f, -2};
  unsigned char data[64];
  for (int i = 0; i < 64; i++) data[i] = (unsigned char)i;

  size_t n = make_st(buf,
                     " { \"__metadata__\" : {\"format\": \"pt\", \"nested\": [1, -2.5e3, true, null, {\"a\": \"b\"}]},"
                     "\"w\": {\"shape\": [2], \"data_offsets\": [0, 8], \"dtype\": \"F32\", \"extra\": [{}]}\n}   ",
                     f2, sizeof f2);
  CHECK_OK(ctx, st_from_bytes(ctx, buf, n, &s));
  if (s) {
    CHECK(attn_safetensors_count(s) == 1 && !strcmp(attn_safetensors_name(s, 0), "w"), "metadata skipped");
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t, s, "w"));
    CHECK(t.dtype == ATTN_F32 && t.rank == 1 && t.shape[0] == 2 && ((float *)t.data)[1] == -2, "w values");
    attn_safetensors_close(s);
    s = NULL;
  }
  /* Escaped names decode to UTF-8; an unknown dtype is listed but refused by get;
   * a misaligned F32 still reads correctly; a scalar; an empty tensor. */
  n = make_st(buf,
              "{\"n\\u00e9\\ud83d\\ude00\\\"\\\\\\n\\/\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]},"
              "\"mis\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[3,11]},"
              "\"i32\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[11,15]},"
              "\"odd\":{\"dtype\":\"F4\",\"shape\":[7],\"data_offsets\":[15,15]},"
              "\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[16,24]},"
              "\"e\":{\"dtype\":\"BF16\",\"shape\":[0,4],\"data_offsets\":[24,24]}}",
              data, 32);
  memcpy(buf + n - 32 + 3, f2, sizeof f2);
  CHECK_OK(ctx, st_from_bytes(ctx, buf, n, &s));
  if (s) {
    const char *nm = "n\xc3\xa9\xf0\x9f\x98\x80\"\\\n/";
    CHECK(attn_safetensors_count(s) == 6, "count");
    CHECK(!strcmp(attn_safetensors_name(s, 0), nm), "escaped name");
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t, s, nm));
    CHECK(t.dtype == ATTN_U8 && ((unsigned char *)t.data)[2] == 2, "u8");
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t, s, "mis"));
    CHECK(((uintptr_t)t.data & 3) == 0 && ((float *)t.data)[0] == 1.5f && ((float *)t.data)[1] == -2, "misaligned");
    CHECK_FAIL(ctx, attn_safetensors_get(ctx, &t, s, "i32"), ATTN_E_DTYPE);
    CHECK(strstr(attn_ctx_error(ctx), "I32"), "dtype named: %s", attn_ctx_error(ctx));
    CHECK_FAIL(ctx, attn_safetensors_get(ctx, &t, s, "odd"), ATTN_E_DTYPE);
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t, s, "s"));
    CHECK(t.rank == 0 && t.dtype == ATTN_F64, "scalar");
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t, s, "e"));
    CHECK(t.rank == 2 && attn_tensor_numel(&t) == 0, "empty");
    CHECK_FAIL(ctx, attn_safetensors_get(ctx, &t, s, "nope"), ATTN_E_NOT_FOUND);
    CHECK_FAIL(ctx, attn_safetensors_get(ctx, &t, s, NULL), ATTN_E_INVALID);
    attn_safetensors_close(s);
    s = NULL;
  }
  /* Rank above ATTN_MAX_RANK: the file opens, that tensor is refused. */
  n = make_st(buf, "{\"r\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", f2, 8);
  CHECK_OK(ctx, st_from_bytes(ctx, buf, n, &s));
  if (s) {
    CHECK_FAIL(ctx, attn_safetensors_get(ctx, &t, s, "r"), ATTN_E_UNSUPPORTED);
    attn_safetensors_close(s);
    s = NULL;
  }
  /* Empty beside a huge dimension, its strides just inside int64. */
  n = make_st(buf, "{\"e\":{\"dtype\":\"U8\",\"shape\":[0,4611686018427387903,2],\"data_offsets\":[0,0]}}", NULL, 0);
  CHECK_OK(ctx, st_from_bytes(ctx, buf, n, &s));
  if (s) {
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t, s, "e"));
    CHECK(attn_tensor_numel(&t) == 0 && t.strides[0] == INT64_MAX - 1 && t.strides[1] == 2, "empty huge strides");
    attn_safetensors_close(s);
    s = NULL;
  }
  n = make_st(buf, "{}      ", NULL, 0);
  CHECK_OK(ctx, st_from_bytes(ctx, buf, n, &s));
  CHECK(s && attn_safetensors_count(s) == 0, "empty header");
  attn_safetensors_close(s);
  s = NULL;

  /* Framing. */
  st_bad_bytes(ctx, "", 0, ATTN_E_FORMAT, "hand.safetensors", __LINE__);
  st_bad_bytes(ctx, "\x02\x00\x00", 3, ATTN_E_FORMAT, NULL, __LINE__);
  st_bad_bytes(ctx, "\0\0\0\0\0\0\0\0{}", 10, ATTN_E_FORMAT, "0", __LINE__);
  st_bad_bytes(ctx, "\x03\0\0\0\0\0\0\0{}", 10, ATTN_E_FORMAT, "truncated", __LINE__);
  st_bad_bytes(ctx, "\x02\0\0\0\0\0\0\x01{}", 10, ATTN_E_FORMAT, "limit", __LINE__);
  st_bad_bytes(ctx, "\xff\xff\xff\xff\xff\xff\xff\xff{}", 10, ATTN_E_FORMAT, NULL, __LINE__);
  st_bad_bytes(ctx, "\x00\x00\x00\x07\0\0\0\0{}", 10, ATTN_E_FORMAT, NULL, __LINE__);

#define BAD(json, nd, want, needle) st_bad(ctx, json, nd, want, needle, __LINE__)
#define T(body) "{\"a\":{" body "}}"
  BAD("hello", 0, ATTN_E_FORMAT, NULL);
  BAD("[]", 0, ATTN_E_FORMAT, NULL);
  BAD("{", 0, ATTN_E_FORMAT, NULL);
  BAD("{\"a", 0, ATTN_E_FORMAT, "unterminated");
  BAD("{\"a\\\"}", 0, ATTN_E_FORMAT, "unterminated");
  BAD("{\"a\":", 0, ATTN_E_FORMAT, NULL);
  BAD("{\"a\":{\"dtype\":\"F32", 0, ATTN_E_FORMAT, "unterminated");
  BAD("{} x", 0, ATTN_E_FORMAT, NULL);
  BAD("{}{}", 0, ATTN_E_FORMAT, NULL);
  BAD("{,}", 0, ATTN_E_FORMAT, NULL);
  BAD("{'a':{}}", 0, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]") ",", 8, ATTN_E_FORMAT, NULL);
  BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},}", 8, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],"), 8, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,9]"), 8, ATTN_E_FORMAT, "beyond");
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,12]"), 12, ATTN_E_FORMAT, "need");
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]"), 8, ATTN_E_FORMAT, "reversed");
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,-8]"), 8, ATTN_E_FORMAT, "negative");
  BAD(T("\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, "negative");
  BAD(T("\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":\"F32\",\"shape\":[2e0],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, "leading zero");
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,99999999999999999999]"), 8, ATTN_E_FORMAT, "large");
  BAD(T("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT,
      "large");
  BAD(T("\"dtype\":\"F64\",\"shape\":[1152921504606846976],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, "large");
  /* No element, but strides past int64 (the unknown I32 and F4 too: 4 and 1 byte). */
  BAD(T("\"dtype\":\"F32\",\"shape\":[0,4611686018427387904,4],\"data_offsets\":[0,0]"), 0, ATTN_E_FORMAT, "large");
  BAD(T("\"dtype\":\"I32\",\"shape\":[4611686018427387904,0,2],\"data_offsets\":[0,0]"), 0, ATTN_E_FORMAT, "large");
  BAD(T("\"dtype\":\"F4\",\"shape\":[0,4611686018427387904,2],\"data_offsets\":[0,0]"), 0, ATTN_E_FORMAT, "large");
  BAD(T("\"dtype\":\"U8\",\"shape\":[0,4611686018427387903,2],\"data_offsets\":[0,0]"), 0, ATTN_OK, NULL);
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]"), 8, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4,8]"), 8, ATTN_E_FORMAT, "two");
  BAD(T("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":\"0,8\""), 8, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, "dtype");
  BAD(T("\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, "shape");
  BAD(T("\"dtype\":\"F32\",\"shape\":[2,],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":\"F32\",\"shape\":[2]"), 8, ATTN_E_FORMAT, "data_offsets");
  BAD(T("\"shape\":[2],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, "dtype");
  BAD(T(""), 8, ATTN_E_FORMAT, NULL);
  BAD(T("\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]"), 8, ATTN_E_FORMAT, "repeat");
  BAD("{\"a\":[1,2]}", 8, ATTN_E_FORMAT, NULL);
  BAD("{\"a\":\"F32\"}", 8, ATTN_E_FORMAT, NULL);
  BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
      16, ATTN_E_FORMAT, "duplicate");
  BAD("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
      16, ATTN_E_FORMAT, "overlap");
  BAD("{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}",
      16, ATTN_E_FORMAT, "overlap");
  BAD("{\"__metadata__\":{},\"__metadata__\":{}}", 0, ATTN_E_FORMAT, "__metadata__");
  BAD("{\"__metadata__\":\"x\"}", 0, ATTN_E_FORMAT, "__metadata__");
  BAD("{\"__metadata__\":{\"a\":tru}}", 0, ATTN_E_FORMAT, NULL);
  BAD("{\"__metadata__\":{\"a\":-}}", 0, ATTN_E_FORMAT, NULL);
  BAD("{\"__metadata__\":{\"a\":1.}}", 0, ATTN_E_FORMAT, NULL);
  BAD("{\"__metadata__\":{\"a\":[1 2]}}", 0, ATTN_E_FORMAT, NULL);
  BAD("{\"__metadata__\":{\"a\" \"b\"}}", 0, ATTN_E_FORMAT, NULL);
  BAD("{\"a\\x\":{}}", 0, ATTN_E_FORMAT, "escape");
  BAD("{\"a\\u12\":{}}", 0, ATTN_E_FORMAT, "escape");
  BAD("{\"a\\ud800\":{}}", 0, ATTN_E_FORMAT, "surrogate");
  BAD("{\"a\\udc00\\ud800\":{}}", 0, ATTN_E_FORMAT, "surrogate");
  BAD("{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0, ATTN_E_FORMAT, "NUL");
  BAD("{\"a\tb\":{}}", 0, ATTN_E_FORMAT, "control");
  BAD("{\"a\xff\":{}}", 0, ATTN_E_FORMAT, "UTF-8");
  BAD("{\"a\xc0\xaf\":{}}", 0, ATTN_E_FORMAT, "UTF-8");
  BAD("{\"a\xed\xa0\x80\":{}}", 0, ATTN_E_FORMAT, "UTF-8");
  BAD("{\"a\xe2\x82\":{}}", 0, ATTN_E_FORMAT, "UTF-8");
#undef T
#undef BAD
  /* Deep nesting in metadata and in an ignored field. */
  char deep[8192];
  size_t k = (size_t)snprintf(deep, sizeof deep, "{\"__metadata__\":{\"x\":");
  for (int i = 0; i < 1000; i++) deep[k++] = '[';
  for (int i = 0; i < 1000; i++) deep[k++] = ']';
  memcpy(deep + k, "}}", 3);
  st_bad(ctx, deep, 0, ATTN_E_FORMAT, "nesting", __LINE__);
  k = (size_t)snprintf(deep, sizeof deep, "{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0],\"x\":");
  for (int i = 0; i < 1000; i++) {
    memcpy(deep + k, "{\"k\":", 5);
    k += 5;
  }
  deep[k] = '\0';
  st_bad(ctx, deep, 0, ATTN_E_FORMAT, "nesting", __LINE__);
  /* Modest nesting is fine. */
  k = (size_t)snprintf(deep, sizeof deep, "{\"__metadata__\":{\"x\":");
  for (int i = 0; i < 20; i++) deep[k++] = '[';
  for (int i = 0; i < 20; i++) deep[k++] = ']';
  memcpy(deep + k, "}}", 3);
  st_bad(ctx, deep, 0, ATTN_OK, NULL, __LINE__);

  char p[1100];
  tpath(p, sizeof p, "does_not_exist.safetensors");
  CHECK_FAIL(ctx, attn_safetensors_open(ctx, &s, p), ATTN_E_IO);
  CHECK(strstr(attn_ctx_error(ctx), p) && strstr(attn_ctx_error(ctx), strerror(ENOENT)), "io message");
  CHECK_FAIL(ctx, attn_safetensors_open(ctx, &s, tdir), ATTN_E_IO);
  CHECK_FAIL(ctx, attn_safetensors_open(ctx, NULL, p), ATTN_E_INVALID);
  CHECK(attn_safetensors_count(NULL) == 0 && attn_safetensors_name(NULL, 0) == NULL, "null handle");
  attn_safetensors_close(NULL);
}

/* ---- lazy reading, in-memory entry points ------------------------------------------ */
static void test_lazy(attn_ctx *ctx) {
  float a[4] = {1, 2, 3, 4}, b[3] = {5, 6, 7};
  int64_t sa[1] = {4}, sb[1] = {3};
  attn_tensor ts[2] = {attn_tensor_view(a, ATTN_F32, 1, sa), attn_tensor_view(b, ATTN_F32, 1, sb)};
  const char *names[2] = {"a", "b"};
  char p[1100];
  tpath(p, sizeof p, "lazy.safetensors");
  CHECK_OK(ctx, attn_safetensors_write(ctx, p, 2, names, ts));
  size_t n;
  unsigned char *bytes = read_bytes(p, &n);
  attn_safetensors *s = NULL;
  CHECK_OK(ctx, attn_safetensors_open(ctx, &s, p));
  /* Tensors are read when asked for: one cut off after opening is an error, not a crash. */
  CHECK(truncate(p, (off_t)(n - 4)) == 0, "truncate: %s", strerror(errno));
  attn_tensor t, t2;
  if (s) {
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t, s, "a"));
    CHECK(t.data && ((float *)t.data)[3] == 4, "a after truncation");
    CHECK_FAIL(ctx, attn_safetensors_get(ctx, &t2, s, "b"), ATTN_E_FORMAT);
    CHECK(strstr(attn_ctx_error(ctx), "shrank") && strstr(attn_ctx_error(ctx), p), "message: %s", attn_ctx_error(ctx));
    /* a view stays valid, and the same, until close */
    CHECK(truncate(p, 0) == 0, "truncate: %s", strerror(errno));
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t2, s, "a"));
    CHECK(t2.data == t.data && ((float *)t.data)[0] == 1, "a read once");
    attn_safetensors_close(s);
  }

  /* The in-memory entry points read what the files hold. */
  CHECK_OK(ctx, attn__safetensors_open_mem(ctx, &s, bytes, n, "mem.safetensors"));
  if (s) {
    CHECK(attn_safetensors_count(s) == 2, "count");
    CHECK_OK(ctx, attn_safetensors_get(ctx, &t, s, "b"));
    CHECK(t.shape[0] == 3 && ((float *)t.data)[2] == 7, "b from memory");
    void *own;
    CHECK_OK(ctx, attn__safetensors_read(ctx, s, "a", &t, &own));
    CHECK(own && t.data == own && ((float *)t.data)[1] == 2, "a read into a buffer of the caller's");
    attn__aligned_free(own);
    CHECK_FAIL(ctx, attn__safetensors_read(ctx, s, "c", &t, &own), ATTN_E_NOT_FOUND);
    CHECK(strstr(attn_ctx_error(ctx), "mem.safetensors"), "the name stands for the path: %s", attn_ctx_error(ctx));
    attn_safetensors_close(s);
  }
  CHECK_FAIL(ctx, attn__safetensors_open_mem(ctx, &s, bytes, n - 5, "cut"), ATTN_E_FORMAT);
  free(bytes);
  tpath(p, sizeof p, "mem.npy");
  CHECK_OK(ctx, attn_npy_write(ctx, p, &ts[0]));
  bytes = read_bytes(p, &n);
  CHECK_OK(ctx, attn__npy_read_mem(ctx, &t, bytes, n, "mem.npy"));
  CHECK(t.data && t.shape[0] == 4 && !memcmp(t.data, a, sizeof a), "npy from memory");
  attn_tensor_free(&t);
  CHECK_FAIL(ctx, attn__npy_read_mem(ctx, &t, bytes, n - 1, "cut.npy"), ATTN_E_FORMAT);
  CHECK(strstr(attn_ctx_error(ctx), "cut.npy"), "npy name: %s", attn_ctx_error(ctx));
  CHECK_FAIL(ctx, attn__npy_read_mem(ctx, &t, NULL, 0, "empty.npy"), ATTN_E_FORMAT);
  free(bytes);
}

/* ---- atomic writes ------------------------------------------------------------------- */
static void test_atomic(attn_ctx *ctx) {
  float v[4] = {1, 2, 3, 4};
  int64_t sh[1] = {4};
  attn_tensor t = attn_tensor_view(v, ATTN_F32, 1, sh);
  char p[1100], q[1100], d[1100];
  tpath(p, sizeof p, "no_such_dir/x.npy");
  CHECK_FAIL(ctx, attn_npy_write(ctx, p, &t), ATTN_E_IO);
  CHECK(strstr(attn_ctx_error(ctx), p) != NULL, "message names the path: %s", attn_ctx_error(ctx));
  const char *nm = "x";
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, p, 1, &nm, &t), ATTN_E_IO);
  tpath(q, sizeof q, "no_such_dir");
  CHECK(!exists(q), "directory appeared");

  /* rename onto a directory fails after the temporary exists: it must go. */
  tpath(d, sizeof d, "a_directory");
  CHECK(mkdir(d, 0777) == 0, "mkdir %s: %s", d, strerror(errno));
  CHECK_FAIL(ctx, attn_npy_write(ctx, d, &t), ATTN_E_IO);
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, d, 1, &nm, &t), ATTN_E_IO);
  CHECK(leftovers() == 0, "temporary left after a failed rename");

  /* Refused writes create nothing. */
  tpath(p, sizeof p, "refused.npy");
  unlink(p);
  attn_tensor b = attn_tensor_view(v, ATTN_BF16, 1, sh);
  CHECK_FAIL(ctx, attn_npy_write(ctx, p, &b), ATTN_E_DTYPE);
  CHECK(!exists(p), "refused npy write left a file");
  attn_tensor bad = t;
  bad.shape[0] = -1;
  CHECK_FAIL(ctx, attn_npy_write(ctx, p, &bad), ATTN_E_SHAPE);
  bad = t;
  bad.data = NULL;
  CHECK_FAIL(ctx, attn_npy_write(ctx, p, &bad), ATTN_E_INVALID);
  CHECK_FAIL(ctx, attn_npy_write(ctx, p, NULL), ATTN_E_INVALID);
  CHECK(!exists(p), "refused npy write left a file");

  tpath(p, sizeof p, "refused.safetensors");
  unlink(p);
  const char *dup[2] = {"a", "a"}, *empty[1] = {""}, *nul[1] = {NULL}, *meta[1] = {"__metadata__"},
             *badu[1] = {"x\xff"};
  attn_tensor two[2] = {t, t};
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, p, 2, dup, two), ATTN_E_INVALID);
  CHECK(strstr(attn_ctx_error(ctx), "duplicate"), "dup message");
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, p, 1, empty, two), ATTN_E_INVALID);
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, p, 1, nul, two), ATTN_E_INVALID);
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, p, 1, meta, two), ATTN_E_INVALID);
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, p, 1, badu, two), ATTN_E_INVALID);
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, p, -1, dup, two), ATTN_E_INVALID);
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, p, 1, NULL, two), ATTN_E_INVALID);
  CHECK_FAIL(ctx, attn_safetensors_write(ctx, NULL, 1, dup, two), ATTN_E_INVALID);
  CHECK(!exists(p), "refused safetensors write left a file");

  /* A write replaces an existing file. */
  tpath(p, sizeof p, "replace.npy");
  CHECK(write_bytes(p, "old contents", 12), "write old");
  CHECK_OK(ctx, attn_npy_write(ctx, p, &t));
  attn_tensor r;
  CHECK_OK(ctx, attn_npy_read(ctx, &r, p));
  CHECK(r.data && ((float *)r.data)[3] == 4, "replaced");
  attn_tensor_free(&r);
  CHECK(leftovers() == 0, "temporaries left");
}

/* ---- mutation fuzz ----------------------------------------------------------------- */
static int valid_status(attn_status st) { return st >= ATTN_OK && st <= ATTN_E_UNSUPPORTED; }

/* Touches every byte a successful open hands out, so ASan sees any bad view. */
static unsigned touch(const attn_tensor *t) {
  unsigned acc = 0;
  int64_t n = attn_tensor_numel(t);
  size_t es = attn_dtype_size(t->dtype);
  for (int64_t i = 0; i < n * (int64_t)es; i++) acc += ((const unsigned char *)t->data)[i];
  return acc;
}

static void test_fuzz(attn_ctx *ctx) {
  tu_rng r = {20240601};
  enum { NBASE = 6 };
  unsigned char *base[NBASE];
  size_t blen[NBASE];
  int is_npy[NBASE];
  char p[1100];
  /* Valid seeds, written by the library itself. */
  {
    float f[6] = {1, 2, 3, 4, 5, 6};
    double dd[1] = {3.5};
    unsigned char u[5] = {1, 0, 1, 1, 0};
    int64_t s23[2] = {2, 3}, s5[1] = {5}, s3[1] = {3};
    attn_tensor a = attn_tensor_view(f, ATTN_F32, 2, s23), sc = attn_tensor_view(dd, ATTN_F64, 0, NULL),
                bo = attn_tensor_view(u, ATTN_BOOL, 1, s5), h = attn_tensor_view(f, ATTN_F16, 1, s3);
    attn_tensor all[4] = {a, sc, bo, h};
    const char *names[4] = {"layer.weight", "scalar", "m\xc3\xa4sk", "half"};
    for (int i = 0; i < 4; i++) {
      snprintf(p, sizeof p, "%s/seed%d.npy", tdir, i);
      CHECK_OK(ctx, attn_npy_write(ctx, p, &all[i]));
      base[i] = read_bytes(p, &blen[i]);
      is_npy[i] = 1;
    }
    snprintf(p, sizeof p, "%s/seed.safetensors", tdir);
    CHECK_OK(ctx, attn_safetensors_write(ctx, p, 4, names, all));
    base[4] = read_bytes(p, &blen[4]);
    is_npy[4] = 0;
    /* A hand-made seed with metadata and escapes, for the JSON paths. */
    unsigned char tmp[512];
    size_t n = make_st(tmp,
                       "{\"__metadata__\":{\"format\":\"pt\",\"v\":[1,2.5e-3,{\"k\":null}]},"
                       "\"a\\u00e9\":{\"dtype\":\"F16\",\"shape\":[2,1],\"data_offsets\":[0,4]},"
                       "\"b\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[4,7]},"
                       "\"c\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[7,15]}}",
                       f, 15);
    base[5] = malloc(n);
    memcpy(base[5], tmp, n);
    blen[5] = n;
    is_npy[5] = 0;
  }
  const char interesting[] = "{}[](),:\"'\\-0123456789 eE.\n\x00\xff\x80TF";
  unsigned char *buf = malloc(8192);
  int bad = 0, ok = 0;
  tpath(p, sizeof p, "fuzz.bin");
  for (int it = 0; it < 4000; it++) {
    int b = (int)tu_int(&r, 0, NBASE - 1);
    size_t n = blen[b];
    memcpy(buf, base[b], n);
    int kind = (int)tu_int(&r, 0, 5), edits = (int)tu_int(&r, 1, 4);
    for (int e = 0; e < edits; e++) {
      /* Header bytes matter most: aim there three times in four. */
      size_t lim = n < 160 || tu_int(&r, 0, 3) == 0 ? n : 160;
      size_t at = (size_t)tu_int(&r, 0, (int64_t)lim - 1);
      switch (kind) {
        case 0: buf[at] ^= (unsigned char)(1u << tu_int(&r, 0, 7)); break;
        case 1: buf[at] = (unsigned char)tu_next(&r); break;
        case 2: buf[at] = (unsigned char)interesting[tu_int(&r, 0, (int64_t)sizeof interesting - 2)]; break;
        case 3: n = (size_t)tu_int(&r, 0, (int64_t)n); break; /* truncate */
        case 4: buf[(size_t)tu_int(&r, 8, 11) % (n ? n : 1)] = (unsigned char)tu_next(&r); break; /* length fields */
        default: { /* shift a run of bytes, as an insertion or deletion would */
          size_t len = (size_t)tu_int(&r, 1, 8);
          if (at + len < n) {
            memmove(buf + at, buf + at + len, n - at - len);
            n -= len;
          }
          break;
        }
      }
      if (n == 0) break;
    }
    if (!write_bytes(p, buf, n)) {
      CHECK(0, "cannot write fuzz file");
      break;
    }
    attn_status st;
    /* Each reader also meets the other format's files now and then. */
    int as_npy = is_npy[b] ^ (tu_int(&r, 0, 15) == 0);
    if (as_npy) {
      attn_tensor t;
      st = attn_npy_read(ctx, &t, p);
      if (st == ATTN_OK) {
        (void)touch(&t);
        attn_tensor_free(&t);
      }
    } else {
      attn_safetensors *s = NULL;
      st = attn_safetensors_open(ctx, &s, p);
      if (st == ATTN_OK) {
        for (int64_t i = 0; i < attn_safetensors_count(s); i++) {
          attn_tensor t;
          const char *nm = attn_safetensors_name(s, i);
          attn_status g = attn_safetensors_get(ctx, &t, s, nm);
          if (!valid_status(g) || (g && !attn_ctx_error(ctx)[0]) ||
              (g != ATTN_OK && g != ATTN_E_DTYPE && g != ATTN_E_UNSUPPORTED))
            bad++;
          if (g == ATTN_OK) (void)touch(&t);
        }
        attn_safetensors_close(s);
      } else if (s != NULL) {
        bad++;
      }
    }
    if (!valid_status(st) || (st != ATTN_OK && !attn_ctx_error(ctx)[0])) {
      bad++;
      fprintf(stderr, "fuzz %d: status %d, message '%s'\n", it, (int)st, attn_ctx_error(ctx));
    }
    ok += st == ATTN_OK;
  }
  CHECK(bad == 0, "%d fuzz cases misbehaved", bad);
  CHECK(ok > 0 && ok < 4000, "fuzz accepted %d of 4000 (expected some, not all)", ok);
  free(buf);
  for (int i = 0; i < NBASE; i++) free(base[i]);
}

/* ---- a file name near NAME_MAX ------------------------------------------------------ */
/* 250 bytes is a valid name; the writers' temporaries must fit beside it. */
/* A write to a symbolic link replaces the file it points to and leaves the link
 * a link (a chain, a relative link, a dangling one); a path with a newline in
 * it gives a one-line message. */
static void test_links_and_messages(attn_ctx *ctx) {
  float v[2] = {1, 2};
  int64_t sh[1] = {2};
  attn_tensor t = attn_tensor_view(v, ATTN_F32, 1, sh), r;
  const char *nm = "x";
  char target[1200], link1[1200], link2[1200], dangling[1200], dtarget[1200];
  tpath(target, sizeof target, "link_target.npy");
  tpath(link1, sizeof link1, "link1.npy");
  tpath(link2, sizeof link2, "link2.npy");
  tpath(dangling, sizeof dangling, "dangling.npy");
  tpath(dtarget, sizeof dtarget, "dangling_target.npy");
  CHECK_OK(ctx, attn_npy_write(ctx, target, &t));
  CHECK(symlink("link_target.npy", link2) == 0 && symlink(link2, link1) == 0, "symlink: %s", strerror(errno));
  v[1] = 7;
  CHECK_OK(ctx, attn_npy_write(ctx, link1, &t));
  struct stat sb;
  CHECK(lstat(link1, &sb) == 0 && S_ISLNK(sb.st_mode) && lstat(link2, &sb) == 0 && S_ISLNK(sb.st_mode),
        "the links stay links");
  CHECK_OK(ctx, attn_npy_read(ctx, &r, target));
  CHECK(r.data && ((float *)r.data)[1] == 7, "the file the links point to is written");
  attn_tensor_free(&r);
  CHECK(symlink("dangling_target.npy", dangling) == 0, "symlink");
  CHECK_OK(ctx, attn_safetensors_write(ctx, dangling, 1, &nm, &t));
  CHECK(lstat(dangling, &sb) == 0 && S_ISLNK(sb.st_mode) && exists(dtarget), "a dangling link gets its target");
  unlink(link1), unlink(link2), unlink(target), unlink(dangling), unlink(dtarget);
  char bad[1200];
  tpath(bad, sizeof bad, "no\nsuch\r\033[2J.npy");
  CHECK(attn_npy_read(ctx, &r, bad) == ATTN_E_IO && !strpbrk(attn_ctx_error(ctx), "\n\r\033"),
        "a path's control characters in a message: %s", attn_ctx_error(ctx));
  CHECK(leftovers() == 0, "temporaries left");
}

static void test_long_name(attn_ctx *ctx) {
  float v[2] = {1, 2};
  int64_t sh[1] = {2};
  attn_tensor t = attn_tensor_view(v, ATTN_F32, 1, sh), r;
  const char *nm = "x";
  char name[251], p[1400];
  for (const char *ext = ".npy"; ext; ext = strcmp(ext, ".npy") ? NULL : ".safetensors") {
    memset(name, 'n', 250 - strlen(ext));
    strcpy(name + 250 - strlen(ext), ext);
    tpath(p, sizeof p, name);
    if (!strcmp(ext, ".npy")) {
      CHECK_OK(ctx, attn_npy_write(ctx, p, &t));
      CHECK_OK(ctx, attn_npy_read(ctx, &r, p));
      CHECK(r.data && ((float *)r.data)[1] == 2, "250-byte npy round trip");
      attn_tensor_free(&r);
    } else {
      CHECK_OK(ctx, attn_safetensors_write(ctx, p, 1, &nm, &t));
      CHECK(exists(p), "250-byte safetensors file");
    }
    unlink(p);
  }
  CHECK(leftovers() == 0, "temporaries left");
}

/* Every slice of every dimension of the npy file at p (shape [2, 3, 5, 4]) equals x's elements there,
 * in the file's dtype (f32, or f64 for f8 and integer files). */
static void check_slices(attn_ctx *ctx, const char *p, const double *x, const char *what) {
  const int64_t shape[4] = {2, 3, 5, 4};
  attn_tensor s;
  for (int dim = 0; dim < 4; dim++)
    for (int64_t start = 0; start <= shape[dim]; start++)
      for (int64_t count = 0; start + count <= shape[dim]; count++) {
        if (attn_npy_read_slice(ctx, &s, p, dim, start, count) != ATTN_OK) {
          CHECK(0, "%s: slice dim %d [%lld, +%lld): %s", what, dim, (long long)start, (long long)count,
                attn_ctx_error(ctx));
          continue;
        }
        int same = s.rank == 4 && s.shape[dim] == count && (s.dtype == ATTN_F32 || s.dtype == ATTN_F64);
        int64_t i[4];
        for (i[0] = 0; i[0] < s.shape[0] && same; i[0]++)
          for (i[1] = 0; i[1] < s.shape[1]; i[1]++)
            for (i[2] = 0; i[2] < s.shape[2]; i[2]++)
              for (i[3] = 0; i[3] < s.shape[3]; i[3]++) {
                int64_t j[4] = {i[0], i[1], i[2], i[3]};
                j[dim] += start;
                const int64_t at = ((i[0] * s.shape[1] + i[1]) * s.shape[2] + i[2]) * s.shape[3] + i[3];
                const double got = s.dtype == ATTN_F32 ? ((float *)s.data)[at] : ((double *)s.data)[at];
                const double want = x[((j[0] * 3 + j[1]) * 5 + j[2]) * 4 + j[3]];
                same &= got == (s.dtype == ATTN_F32 ? (double)(float)want : want);
              }
        CHECK(same, "%s: slice dim %d [%lld, +%lld) differs from the array", what, dim, (long long)start,
              (long long)count);
        attn_tensor_free(&s);
      }
}

/* x [2, 3, 5, 4] as an npy file at p in the descr's type and byte order ('<f4', '>f8', '>i4', ...), in
 * Fortran order (the first index fastest) if fortran. */
static void write_npy_as(const char *p, const char *descr, int fortran, const double *x) {
  const int64_t shape[4] = {2, 3, 5, 4};
  static unsigned char file[128 + 120 * 8];
  char hdr[128];
  const uint16_t one = 1;
  const int es = descr[2] - '0', swap = (descr[0] == '>') == (*(const unsigned char *)&one == 1);
  const int hn = snprintf(hdr, sizeof hdr, "{'descr': '%s', 'fortran_order': %s, 'shape': (2, 3, 5, 4), }", descr,
                          fortran ? "True" : "False");
  memset(file, ' ', 128);
  memcpy(file, "\x93NUMPY\x01\x00", 8);
  file[8] = 118, file[9] = 0;
  memcpy(file + 10, hdr, (size_t)hn);
  file[127] = '\n';
  int64_t i[4], n = 0;
  for (i[3] = 0; i[3] < (fortran ? shape[3] : 1); i[3]++) /* Fortran order: the last index slowest */
    for (i[2] = 0; i[2] < (fortran ? shape[2] : 1); i[2]++)
      for (i[1] = 0; i[1] < (fortran ? shape[1] : 1); i[1]++)
        for (i[0] = 0; i[0] < (fortran ? shape[0] : 120); i[0]++, n++) {
          const double v = fortran ? x[((i[0] * 3 + i[1]) * 5 + i[2]) * 4 + i[3]] : x[i[0]];
          unsigned char b[8];
          if (descr[1] == 'i') {
            const int32_t w = (int32_t)v;
            memcpy(b, &w, 4);
          } else if (es == 4) {
            const float f = (float)v;
            memcpy(b, &f, 4);
          } else {
            memcpy(b, &v, 8);
          }
          for (int k = 0; k < es; k++) file[128 + n * es + k] = b[swap ? es - 1 - k : k];
        }
  FILE *f = fopen(p, "wb");
  if (f) fwrite(file, 1, 128 + (size_t)(120 * es), f), fclose(f);
}

/* attn_npy_read_slice: every slice of every dimension equals the whole array's
 * elements there, for files in C and Fortran order, little- and big-endian, f32,
 * f64 and int32 (read as exact f64); attn_npy_info the header's shape;
 * out-of-range slices and a truncated file are refused. */
static void test_slices(attn_ctx *ctx) {
  char p[1100];
  tpath(p, sizeof p, "slice.npy");
  tu_rng r = {7};
  const int64_t shape[4] = {2, 3, 5, 4};
  float x[120];
  double xd[120], xi[120];
  for (int i = 0; i < 120; i++) xd[i] = x[i] = (float)tu_uniform(&r), xi[i] = (double)(i * 7919 % 200003) - 1e5;
  attn_tensor src = attn_tensor_view(x, ATTN_F32, 4, shape), info, s;
  CHECK_OK(ctx, attn_npy_write(ctx, p, &src));
  CHECK_OK(ctx, attn_npy_info(ctx, &info, p));
  CHECK(info.data == NULL && info.rank == 4 && info.dtype == ATTN_F32 && info.shape[2] == 5, "npy_info: rank %d",
        info.rank);
  check_slices(ctx, p, xd, "attn_npy_write's file");
  static const char *const descrs[] = {"<f4", ">f4", "<f8", ">f8", "<i4", ">i4"};
  for (int d = 0; d < 6; d++)
    for (int fortran = 0; fortran < 2; fortran++) {
      char what[64];
      snprintf(what, sizeof what, "%s, %s order", descrs[d], fortran ? "Fortran" : "C");
      write_npy_as(p, descrs[d], fortran, descrs[d][1] == 'i' ? xi : xd);
      CHECK_OK(ctx, attn_npy_info(ctx, &info, p));
      CHECK(info.rank == 4 && info.shape[0] == 2 && info.shape[3] == 4, "%s: npy_info's shape", what);
      check_slices(ctx, p, descrs[d][1] == 'i' ? xi : xd, what);
    }
  CHECK_ERR(ctx, attn_npy_read_slice(ctx, &s, p, 2, 4, 2), ATTN_E_SHAPE, "dimension 2");
  CHECK_ERR(ctx, attn_npy_read_slice(ctx, &s, p, 4, 0, 1), ATTN_E_SHAPE, "rank 4");
  CHECK_ERR(ctx, attn_npy_read_slice(ctx, &s, p, 1, -1, 1), ATTN_E_SHAPE, "dimension 1");
  CHECK_ERR(ctx, attn_npy_read_slice(ctx, &s, p, -1, 0, 1), ATTN_E_INVALID, "negative");
  if (truncate(p, 200) == 0) { /* the header survives, the data does not: refused before any slice is read */
    CHECK_ERR(ctx, attn_npy_read_slice(ctx, &s, p, 0, 0, 1), ATTN_E_FORMAT, "truncated");
    CHECK_ERR(ctx, attn_npy_read(ctx, &s, p), ATTN_E_FORMAT, "truncated");
  }
  unlink(p);
}

int main(void) {
  const char *env = getenv("ATTN_TEST_TMP");
  snprintf(tdir, sizeof tdir, "%s/test_io_%ld", env && env[0] ? env : "/tmp", (long)getpid());
  if (mkdir(tdir, 0777) != 0) {
    fprintf(stderr, "cannot create %s: %s\n", tdir, strerror(errno));
    return 1;
  }
  attn_ctx *ctx = NULL;
  if (attn_ctx_create(&ctx) != ATTN_OK) return 1;
  test_roundtrip(ctx);
  test_npy_handmade(ctx);
  test_slices(ctx);
  test_st_handmade(ctx);
  test_lazy(ctx);
  test_atomic(ctx);
  test_fuzz(ctx);
  test_long_name(ctx);
  test_links_and_messages(ctx);
  attn_ctx_destroy(ctx);
  cleanup_dir();
  return tu_finish("test_io");
}
