/* The output files of a command: checked before it runs, staged in temporary
 * files while it runs, renamed into place when everything was written (cli.h). */
#define _XOPEN_SOURCE 700 /* realpath */
#include "cli.h"
#include "io/file.h" /* attn__follow_links: the library's writers follow links the same way */

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The length of the directory part of path, its last '/' included (0: none). */
static size_t dir_len(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash ? (size_t)(slash - path) + 1 : 0;
}

static char *concat(const char *a, size_t la, const char *b) {
  const size_t lb = strlen(b);
  char *s = malloc(la + lb + 1);
  if (s) {
    memcpy(s, a, la);
    memcpy(s + la, b, lb + 1);
  }
  return s;
}

/* One name per file however it is spelt: the real path of path's directory
 * and its last component (the file need not exist). NULL where the directory
 * cannot be resolved. */
static char *canonical(const char *path, int follow) {
  char buf[PATH_MAX];
  if (follow && realpath(path, buf)) return strdup(buf);
  const size_t d = dir_len(path);
  char *dir = d ? concat(path, d, "") : strdup(".");
  const int ok = dir && realpath(dir, buf) != NULL;
  free(dir);
  if (!ok) return NULL;
  const size_t lb = strlen(buf);
  if (lb + 1 >= sizeof buf) return NULL;
  buf[lb] = '/';
  return concat(buf, lb + 1, path + d);
}

/* Whether a and b are one file: the same inode where both exist, else the same canonical name. */
typedef struct file_id {
  int exists;
  struct stat sb;
  char *name;
} file_id;

static void file_id_get(file_id *f, const char *path, int follow) {
  f->exists = stat(path, &f->sb) == 0;
  f->name = canonical(path, follow);
}

static int same_file(const file_id *a, const file_id *b) {
  if (a->exists && b->exists) return a->sb.st_dev == b->sb.st_dev && a->sb.st_ino == b->sb.st_ino;
  return a->name && b->name && !strcmp(a->name, b->name);
}

/* Checks output i (recorded in o) on its own: 0 or an exit code. */
static int check_target(cli_outputs *o, int i) {
  const char *flag = o->o[i].flag, *path = o->o[i].path, *target = o->o[i].target;
  struct stat sb;
  const int found = lstat(target, &sb) == 0, lerr = found ? 0 : errno;
  if (found && !S_ISREG(sb.st_mode))
    return cli_fail(CLI_EXIT_USAGE, "%s '%s' is %s", flag, cli_show(path),
                    S_ISDIR(sb.st_mode) ? "a directory" : "not a regular file");
  /* a name the final rename would refuse (too long, below a file) fails now, before any output is in place */
  if (!found && lerr != ENOENT) return cli_fail(CLI_EXIT_FAIL, "%s '%s': %s", flag, cli_show(path), strerror(lerr));
  const size_t d = dir_len(target);
  char *dir = d ? concat(target, d, "") : strdup(".");
  if (!dir) return cli_fail(CLI_EXIT_FAIL, "out of memory");
  int err = 0;
  if (stat(dir, &sb) != 0) err = errno;
  else if (!S_ISDIR(sb.st_mode)) err = ENOTDIR;
  else if (access(dir, W_OK | X_OK) != 0) err = errno;
  free(dir);
  if (err) return cli_fail(CLI_EXIT_FAIL, "%s '%s': cannot write in its directory: %s", flag, cli_show(path), strerror(err));
  return 0;
}

int cli_outputs_plan(cli_outputs *o, cli_args *a, const char *const *outputs, const char *const *inputs) {
  memset(o, 0, sizeof *o);
  file_id id[CLI_MAX_OUTPUTS];
  int r = 0, nid = 0;
  for (int f = 0; outputs[f] && !r; f++) {
    const char *path = cli_get(a, outputs[f]);
    if (!path) continue;
    if (!*path) {
      r = cli_fail(CLI_EXIT_USAGE, "%s needs a file name", outputs[f]);
      break;
    }
    if (o->n == CLI_MAX_OUTPUTS) {
      r = cli_fail(CLI_EXIT_USAGE, "too many outputs");
      break;
    }
    const int i = o->n;
    o->o[i].flag = outputs[f];
    o->o[i].path = path;
    errno = 0;
    if (!(o->o[i].target = attn__follow_links(path))) {
      r = errno == ENOMEM ? cli_fail(CLI_EXIT_FAIL, "out of memory")
                          : cli_fail(CLI_EXIT_FAIL, "%s '%s': cannot follow the link: %s", outputs[f],
                                     cli_show(path), strerror(errno));
      break;
    }
    o->n++;
    if ((r = check_target(o, i))) break;
    file_id_get(&id[nid++], o->o[i].target, 0);
    for (int j = 0; j < i && !r; j++)
      if (same_file(&id[i], &id[j]))
        r = cli_fail(CLI_EXIT_USAGE, "%s and %s name the same file '%s'", o->o[j].flag, outputs[f], cli_show(path));
    for (int k = 0; inputs[k] && !r; k++) {
      const char *in = cli_get(a, inputs[k]);
      if (!in || !*in) continue;
      file_id fin;
      file_id_get(&fin, in, 1);
      if (same_file(&id[i], &fin))
        r = cli_fail(CLI_EXIT_USAGE, "%s '%s' is the input %s: an output never replaces an input", outputs[f],
                     cli_show(path), inputs[k]);
      free(fin.name);
    }
  }
  for (int i = 0; i < nid; i++) free(id[i].name);
  return r;
}

const char *cli_outputs_stage(cli_outputs *o, const char *flag) {
  int i = 0;
  while (i < o->n && strcmp(o->o[i].flag, flag)) i++;
  if (i == o->n) {
    cli_fail(CLI_EXIT_FAIL, "%s: not a planned output", flag); /* a bug of the command, not of its user */
    return NULL;
  }
  if (o->o[i].tmp) {
    unlink(o->o[i].tmp);
    free(o->o[i].tmp);
  }
  /* a short name beside the target: the rename stays within one file system,
   * and it fits in NAME_MAX whatever the target's name is */
  o->o[i].tmp = concat(o->o[i].target, dir_len(o->o[i].target), ".attn.tmp.XXXXXX");
  if (!o->o[i].tmp) {
    cli_fail(CLI_EXIT_FAIL, "out of memory");
    return NULL;
  }
  const int fd = mkstemp(o->o[i].tmp);
  if (fd < 0) {
    cli_fail(CLI_EXIT_FAIL, "%s '%s': cannot create a temporary file next to it: %s", flag, cli_show(o->o[i].path),
             strerror(errno));
    free(o->o[i].tmp);
    o->o[i].tmp = NULL;
    return NULL;
  }
  close(fd);
  return o->o[i].tmp;
}

int cli_outputs_commit(cli_outputs *o) {
  char done[CLI_MAX_OUTPUTS * 24] = "";
  for (int i = 0; i < o->n; i++) {
    if (!o->o[i].tmp) continue;
    if (rename(o->o[i].tmp, o->o[i].target) != 0) {
      /* The outputs renamed before this one have replaced their targets: a
       * rename cannot be taken back. Say which, so the user knows what changed. */
      const int err = errno;
      return cli_fail(CLI_EXIT_FAIL, "%s '%s': cannot rename the finished file over it: %s; %s%s", o->o[i].flag,
                      cli_show(o->o[i].path), strerror(err), *done ? "already replaced: " : "no output was replaced",
                      done);
    }
    free(o->o[i].tmp);
    o->o[i].tmp = NULL;
    snprintf(done + strlen(done), sizeof done - strlen(done), "%s%s", *done ? ", " : "", o->o[i].flag);
  }
  return 0;
}

void cli_outputs_free(cli_outputs *o) {
  for (int i = 0; i < o->n; i++) {
    if (o->o[i].tmp) unlink(o->o[i].tmp);
    free(o->o[i].tmp);
    free(o->o[i].target);
  }
  o->n = 0;
}

/* Writes t as .npy into a staged temporary for flag's output (renamed into place by cli_outputs_commit). */
int cli_write_npy(attn_ctx *ctx, cli_outputs *o, const char *flag, const attn_tensor *t) {
  const char *tmp = cli_outputs_stage(o, flag);
  if (!tmp) return CLI_EXIT_FAIL;
  if (attn_npy_write(ctx, tmp, t)) return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  return 0;
}

int cli_write_safetensors(attn_ctx *ctx, cli_outputs *o, const char *flag, int64_t count,
                                    const char *const *names, const attn_tensor *t) {
  const char *tmp = cli_outputs_stage(o, flag);
  if (!tmp) return CLI_EXIT_FAIL;
  if (attn_safetensors_write(ctx, tmp, count, names, t)) return cli_fail(CLI_EXIT_FAIL, "%s: %s", flag, attn_ctx_error(ctx));
  return 0;
}
