/* npy_compare A.npy B.npy TOL: exit 0 when A and B have one shape and a relative
 * L2 error (of A against B) of at most TOL. A helper for the CLI tests. */
#include "testutil.h"

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: npy_compare A.npy B.npy TOL\n");
    return 2;
  }
  attn_ctx *ctx;
  attn_ctx_create(&ctx);
  attn_tensor a, b;
  if (attn_npy_read(ctx, &a, argv[1]) || attn_npy_read(ctx, &b, argv[2])) {
    fprintf(stderr, "npy_compare: %s\n", attn_ctx_error(ctx));
    return 1;
  }
  int same = a.rank == b.rank && a.rank <= 4;
  for (int i = 0; same && i < a.rank; i++) same = a.shape[i] == b.shape[i];
  if (!same) {
    fprintf(stderr, "npy_compare: shapes differ\n");
    return 1;
  }
  double *x = tu_to_f64(&a), *y = tu_to_f64(&b);
  const int64_t n = attn_tensor_numel(&a);
  const double e = tu_rel_l2(x, y, n), tol = atof(argv[3]);
  printf("%s vs %s: rel L2 %.3g (tol %.3g)\n", argv[1], argv[2], e, tol);
  free(x); free(y);
  attn_tensor_free(&a); attn_tensor_free(&b);
  attn_ctx_destroy(ctx);
  return e <= tol ? 0 : 1; /* NaN compares false: a NaN error fails */
}
