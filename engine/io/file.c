/* file.c: files and directories for checkpoints, safetensors and token
 * shards: positioned reads and writes that retry until done, fsync, atomic
 * renames, mkdir -p, removal of a directory tree, sorted directory listings.
 * POSIX calls only (no shell); every failure names the call, the path and
 * the system's reason. */
#define _GNU_SOURCE
#include "internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

struct fsdp_file {
    int fd;
    int writable;
    int64_t end;          /* where fsdp_file_append writes next */
    char path[];          /* for messages */
};

struct fsdp_dir_listing {
    int64_t count;
    char **names;         /* sorted, without "." and ".." */
};

/* One read or write call moves at most this much (Linux caps a call near 2 GiB). */
#define IO_MAX_CALL ((size_t)1 << 30)

static fsdp_status io_error(const char *op, const char *path, int err) {
    return fsdp_set_error(FSDP_ERR_IO, "%s: '%s': %s", op, path ? path : "(null)", strerror(err));
}

static fsdp_status check_path(const char *op, const char *path) {
    if (!path || !path[0]) return fsdp_set_error(FSDP_ERR_INVALID, "%s: path is NULL or empty", op);
    return FSDP_OK;
}

fsdp_status fsdp_file_open(fsdp_file **out, const char *path, fsdp_file_mode mode) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_file_open: out is NULL");
    *out = NULL;
    FSDP_TRY(check_path("fsdp_file_open", path));
    int flags;
    /* reading: O_NONBLOCK so that a FIFO cannot hang the open (the flag is
     * cleared once fstat shows a regular file). creating: whatever is at the
     * name (a planted symbolic link, an old file) is unlinked, never followed,
     * and the new file must be ours (O_EXCL|O_NOFOLLOW). */
    if (mode == FSDP_FILE_READ) flags = O_RDONLY | O_NONBLOCK;
    else if (mode == FSDP_FILE_CREATE) flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW;
    else return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_file_open: '%s': unknown mode %d", path, mode);
    if (mode == FSDP_FILE_CREATE) {
        struct stat lb;
        if (lstat(path, &lb) == 0) {
            if (S_ISDIR(lb.st_mode)) return io_error("cannot create", path, EISDIR);
            if (unlink(path) != 0 && errno != ENOENT) return io_error("cannot replace", path, errno);
        }
    }
    size_t len = strlen(path);
    fsdp_file *f = malloc(sizeof *f + len + 1);
    if (!f) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_file_open: '%s': out of memory", path);
    memcpy(f->path, path, len + 1);
    do {
        f->fd = open(path, flags | O_CLOEXEC, 0644);
    } while (f->fd < 0 && errno == EINTR);
    if (f->fd < 0) {
        int e = errno;
        free(f);
        return io_error(mode == FSDP_FILE_READ ? "cannot open" : "cannot create", path, e);
    }
    if (mode == FSDP_FILE_READ) {
        struct stat sb;
        const char *what = NULL;
        if (fstat(f->fd, &sb) != 0) what = "cannot be examined (fstat failed), so it is";
        else if (S_ISDIR(sb.st_mode)) {
            close(f->fd);
            free(f);
            return io_error("cannot open", path, EISDIR);
        }
        else if (S_ISFIFO(sb.st_mode)) what = "is a FIFO (named pipe)";
        else if (S_ISCHR(sb.st_mode)) what = "is a character device";
        else if (S_ISBLK(sb.st_mode)) what = "is a block device";
        else if (S_ISSOCK(sb.st_mode)) what = "is a socket";
        else if (!S_ISREG(sb.st_mode)) what = "is something else";
        if (!what) {
            int fl = fcntl(f->fd, F_GETFL);
            if (fl != -1) fcntl(f->fd, F_SETFL, fl & ~O_NONBLOCK);
        } else {
            close(f->fd);
            fsdp_status st = fsdp_set_error(FSDP_ERR_IO, "cannot open: '%s': it %s, not a regular file", path, what);
            free(f);
            return st;
        }
    }
    f->writable = mode == FSDP_FILE_CREATE;
    f->end = 0;
    *out = f;
    return FSDP_OK;
}

fsdp_status fsdp_file_close(fsdp_file *f) {
    if (!f) return FSDP_OK;
    int rc = close(f->fd);
    int e = errno;
    fsdp_status st = FSDP_OK;
    /* a failed close of a written file may mean lost data (NFS, quota) */
    if (rc != 0 && e != EINTR && f->writable) st = io_error("close failed", f->path, e);
    free(f);
    return st;
}

fsdp_status fsdp_file_size(fsdp_file *f, int64_t *bytes) {
    if (!f || !bytes) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_file_size: NULL argument");
    struct stat sb;
    if (fstat(f->fd, &sb) != 0) return io_error("fstat failed", f->path, errno);
    *bytes = (int64_t)sb.st_size;
    return FSDP_OK;
}

static fsdp_status check_range(const char *op, fsdp_file *f, const void *buf, int64_t n, int64_t offset) {
    if (!f) return fsdp_set_error(FSDP_ERR_INVALID, "%s: file is NULL", op);
    if (n < 0 || offset < 0 || (n > 0 && !buf) || n > INT64_MAX - offset)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: '%s': bad range (%lld bytes at offset %lld, buffer %p)", op,
                              f->path, (long long)n, (long long)offset, buf);
    return FSDP_OK;
}

fsdp_status fsdp_file_pread(fsdp_file *f, void *dst, int64_t n, int64_t offset, int64_t *got) {
    FSDP_TRY(check_range("fsdp_file_pread", f, dst, n, offset));
    if (!got) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_file_pread: got is NULL");
    int64_t done = 0;
    while (done < n) {
        size_t len = (size_t)(n - done) < IO_MAX_CALL ? (size_t)(n - done) : IO_MAX_CALL;
        ssize_t k = pread(f->fd, (char *)dst + done, len, (off_t)(offset + done));
        if (k < 0) {
            if (errno == EINTR) continue;
            *got = done;
            return io_error("read failed", f->path, errno);
        }
        if (k == 0) break;   /* end of file */
        done += k;
    }
    *got = done;
    return FSDP_OK;
}

static fsdp_status write_at(fsdp_file *f, const void *src, int64_t n, int64_t offset) {
    if (!f->writable) return fsdp_set_error(FSDP_ERR_INVALID, "write: '%s' is open for reading", f->path);
    int64_t done = 0;
    while (done < n) {
        size_t len = (size_t)(n - done) < IO_MAX_CALL ? (size_t)(n - done) : IO_MAX_CALL;
        ssize_t k = pwrite(f->fd, (const char *)src + done, len, (off_t)(offset + done));
        if (k < 0) {
            if (errno == EINTR) continue;
            return io_error("write failed", f->path, errno);
        }
        if (k == 0) return io_error("write failed", f->path, ENOSPC);
        done += k;
    }
    if (offset + n > f->end) f->end = offset + n;
    return FSDP_OK;
}

fsdp_status fsdp_file_pwrite(fsdp_file *f, const void *src, int64_t n, int64_t offset) {
    FSDP_TRY(check_range("fsdp_file_pwrite", f, src, n, offset));
    return write_at(f, src, n, offset);
}

fsdp_status fsdp_file_append(fsdp_file *f, const void *src, int64_t n) {
    FSDP_TRY(check_range("fsdp_file_append", f, src, n, f ? f->end : 0));
    return write_at(f, src, n, f->end);
}

fsdp_status fsdp_file_sync(fsdp_file *f) {
    if (!f) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_file_sync: file is NULL");
    if (fsync(f->fd) != 0) return io_error("fsync failed", f->path, errno);
    return FSDP_OK;
}

/* The folder holding path ("." when it names none), into buf of size n. */
static void parent_of(const char *path, char *buf, size_t n) {
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/') len--;
    while (len > 0 && path[len - 1] != '/') len--;
    while (len > 1 && path[len - 1] == '/') len--;
    if (len == 0) {
        snprintf(buf, n, ".");
        return;
    }
    if (len >= n) len = n - 1;
    memcpy(buf, path, len);
    buf[len] = 0;
}

fsdp_status fsdp_path_sync(const char *path) {
    FSDP_TRY(check_path("fsdp_path_sync", path));
    int fd;
    do {
        fd = open(path, O_RDONLY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return io_error("cannot open (to fsync)", path, errno);
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    /* some filesystems refuse fsync on a directory: the rename stands anyway */
    if (rc != 0 && e != EINVAL && e != EROFS) return io_error("fsync failed", path, e);
    return FSDP_OK;
}

fsdp_status fsdp_path_rename(const char *from, const char *to) {
    FSDP_TRY(check_path("fsdp_path_rename", from));
    FSDP_TRY(check_path("fsdp_path_rename", to));
    if (rename(from, to) != 0)
        return fsdp_set_error(FSDP_ERR_IO, "cannot rename '%s' to '%s': %s", from, to, strerror(errno));
    char dir[PATH_MAX];
    parent_of(to, dir, sizeof dir);
    return fsdp_path_sync(dir);   /* the new name is durable */
}

fsdp_status fsdp_file_write_atomic(const char *path, const void *src, int64_t n) {
    FSDP_TRY(check_path("fsdp_file_write_atomic", path));
    if (n < 0 || (n > 0 && !src))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_file_write_atomic: '%s': bad buffer (%lld bytes)", path,
                              (long long)n);
    size_t len = strlen(path);
    char *tmp = malloc(len + 5);
    if (!tmp) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_file_write_atomic: out of memory");
    memcpy(tmp, path, len);
    memcpy(tmp + len, ".tmp", 5);
    fsdp_file *f;
    fsdp_status st = fsdp_file_open(&f, tmp, FSDP_FILE_CREATE);
    if (st == FSDP_OK) {
        st = write_at(f, src, n, 0);
        if (st == FSDP_OK) st = fsdp_file_sync(f);
        fsdp_status cst = fsdp_file_close(f);
        if (st == FSDP_OK) st = cst;
        if (st == FSDP_OK) st = fsdp_path_rename(tmp, path);
        if (st != FSDP_OK) unlink(tmp);
    }
    free(tmp);
    return st;
}

fsdp_status fsdp_path_stat(const char *path, fsdp_path_kind *kind, int64_t *bytes) {
    if (!kind) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_path_stat: kind is NULL");
    FSDP_TRY(check_path("fsdp_path_stat", path));
    struct stat sb;
    if (bytes) *bytes = 0;
    if (stat(path, &sb) != 0) {
        if (errno == ENOENT || errno == ENOTDIR) {
            *kind = FSDP_PATH_NONE;
            return FSDP_OK;
        }
        return io_error("cannot stat", path, errno);
    }
    *kind = S_ISREG(sb.st_mode) ? FSDP_PATH_FILE : S_ISDIR(sb.st_mode) ? FSDP_PATH_DIR : FSDP_PATH_OTHER;
    if (bytes) *bytes = (int64_t)sb.st_size;
    return FSDP_OK;
}

fsdp_status fsdp_path_mkdirs(const char *path) {
    FSDP_TRY(check_path("fsdp_path_mkdirs", path));
    size_t len = strlen(path);
    if (len >= PATH_MAX) return fsdp_set_error(FSDP_ERR_INVALID, "cannot create directory '%s': path too long", path);
    char buf[PATH_MAX];
    memcpy(buf, path, len + 1);
    /* each prefix ending before a '/', then the whole path */
    for (size_t i = 1; i <= len; i++) {
        if (i < len && buf[i] != '/') continue;
        if (i < len && buf[i - 1] == '/') continue;   /* "a//b" */
        char saved = buf[i];
        buf[i] = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            buf[i] = saved;
            return fsdp_set_error(FSDP_ERR_IO, "cannot create directory '%.*s': %s", (int)i, path, strerror(e));
        }
        buf[i] = saved;
    }
    struct stat sb;
    if (stat(path, &sb) != 0) return fsdp_set_error(FSDP_ERR_IO, "cannot create directory '%s': %s", path, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return fsdp_set_error(FSDP_ERR_IO, "cannot create directory '%s': a file of that name exists", path);
    return FSDP_OK;
}

/* Removes the entry name inside the open directory dfd (recursively for a
 * directory; a symbolic link is removed, never followed). */
static fsdp_status remove_at(int dfd, const char *name, const char *top, int depth) {
    if (depth > 256) return fsdp_set_error(FSDP_ERR_IO, "cannot remove '%s': directories nested too deep", top);
    struct stat sb;
    if (fstatat(dfd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) return FSDP_OK;
        return io_error("cannot stat (to remove)", top, errno);
    }
    if (S_ISDIR(sb.st_mode)) {
        int fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) return io_error("cannot open (to remove)", top, errno);
        DIR *d = fdopendir(fd);
        if (!d) {
            close(fd);
            return io_error("cannot list (to remove)", top, errno);
        }
        fsdp_status st = FSDP_OK;
        struct dirent *e;
        while (st == FSDP_OK && (errno = 0, e = readdir(d)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            st = remove_at(dirfd(d), e->d_name, top, depth + 1);
        }
        closedir(d);
        if (st != FSDP_OK) return st;
        if (unlinkat(dfd, name, AT_REMOVEDIR) != 0 && errno != ENOENT) return io_error("cannot remove", top, errno);
        return FSDP_OK;
    }
    if (unlinkat(dfd, name, 0) != 0 && errno != ENOENT) return io_error("cannot remove", top, errno);
    return FSDP_OK;
}

fsdp_status fsdp_path_remove_tree(const char *path) {
    FSDP_TRY(check_path("fsdp_path_remove_tree", path));
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/') len--;
    if ((len == 1 && path[0] == '/') || (len == 1 && path[0] == '.') || (len == 2 && !strncmp(path, "..", 2)))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_path_remove_tree: refusing to remove '%s'", path);
    return remove_at(AT_FDCWD, path, path, 0);
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

fsdp_status fsdp_dir_listing_free(fsdp_dir_listing *l) {
    if (!l) return FSDP_OK;
    for (int64_t i = 0; i < l->count; i++) free(l->names[i]);
    free(l->names);
    free(l);
    return FSDP_OK;
}

fsdp_status fsdp_dir_list(fsdp_dir_listing **out, const char *path) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_dir_list: out is NULL");
    *out = NULL;
    FSDP_TRY(check_path("fsdp_dir_list", path));
    DIR *d = opendir(path);
    if (!d) return io_error("cannot list directory", path, errno);
    fsdp_dir_listing *l = calloc(1, sizeof *l);
    int64_t cap = 0;
    fsdp_status st = l ? FSDP_OK : fsdp_set_error(FSDP_ERR_OOM, "fsdp_dir_list: '%s': out of memory", path);
    struct dirent *e;
    while (st == FSDP_OK && (errno = 0, e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (l->count == cap) {
            int64_t ncap = cap ? 2 * cap : 16;
            char **nn = realloc(l->names, (size_t)ncap * sizeof *nn);
            if (!nn) {
                st = fsdp_set_error(FSDP_ERR_OOM, "fsdp_dir_list: '%s': out of memory", path);
                break;
            }
            l->names = nn;
            cap = ncap;
        }
        char *name = strdup(e->d_name);
        if (!name) {
            st = fsdp_set_error(FSDP_ERR_OOM, "fsdp_dir_list: '%s': out of memory", path);
            break;
        }
        l->names[l->count++] = name;
    }
    if (st == FSDP_OK && errno != 0) st = io_error("cannot list directory", path, errno);
    closedir(d);
    if (st != FSDP_OK) {
        fsdp_dir_listing_free(l);
        return st;
    }
    if (l->count > 1) qsort(l->names, (size_t)l->count, sizeof *l->names, by_name);
    *out = l;
    return FSDP_OK;
}

fsdp_status fsdp_dir_listing_count(fsdp_dir_listing *l, int64_t *n) {
    if (!l || !n) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_dir_listing_count: NULL argument");
    *n = l->count;
    return FSDP_OK;
}

fsdp_status fsdp_dir_listing_name(fsdp_dir_listing *l, int64_t i, const char **name) {
    if (!l || !name) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_dir_listing_name: NULL argument");
    if (i < 0 || i >= l->count)
        return fsdp_set_error(FSDP_ERR_INDEX, "fsdp_dir_listing_name: index %lld outside [0, %lld)", (long long)i,
                              (long long)l->count);
    *name = l->names[i];
    return FSDP_OK;
}
