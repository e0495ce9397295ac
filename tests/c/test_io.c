/* test_io.c: engine/io through the public header: XXH64 against published
 * digests and against itself streamed in every split of a buffer; files
 * (append, pwrite, pread at and past the end, atomic writes); directories
 * (mkdir -p, listing, removal); and the error path of every call, which
 * returns a status and a message naming the call and the path. */
#define _GNU_SOURCE /* mkdtemp */
#include "fsdp.h"
#include "testutil.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int has(const char *needle) { return strstr(fsdp_last_error(), needle) != NULL; }

static void check_hash(void) {
    /* published XXH64 digests, seed 0 */
    struct { const char *text; uint64_t want; } v[] = {
        {"", 0xEF46DB3751D8E999ULL},
        {"a", 0xD24EC4F1A98C6E5BULL},
        {"abc", 0x44BC2CF5AD770999ULL},
        {"Nobody inspects the spammish repetition", 0xFBCEA83C8A378BF1ULL},
    };
    for (int i = 0; i < 4; i++) {
        uint64_t h = 0;
        test_check(fsdp_hash64(v[i].text, (int64_t)strlen(v[i].text), 0, &h) == FSDP_OK && h == v[i].want,
                   "XXH64(\"%s\") = %016llx, want %016llx", v[i].text, (unsigned long long)h,
                   (unsigned long long)v[i].want);
    }
    /* every split point of a 101-byte buffer (odd: a partial stripe and a tail) */
    uint8_t buf[101];
    for (int i = 0; i < 101; i++) buf[i] = (uint8_t)(i * 37 + 11);
    uint64_t want = 0, got = 0;
    fsdp_hash64(buf, 101, 7, &want);
    fsdp_hasher *h = NULL;
    test_check(fsdp_hasher_new(&h, 7) == FSDP_OK, "hasher_new");
    int bad = 0;
    for (int cut = 0; cut <= 101; cut++) {
        fsdp_hasher_reset(h, 7);
        fsdp_hasher_update(h, buf, cut);
        fsdp_hasher_update(h, buf + cut, 101 - cut);
        fsdp_hasher_digest(h, &got);
        if (got != want) bad++;
    }
    test_check(bad == 0, "streamed XXH64 equals one shot at all 102 split points (%d differ)", bad);
    fsdp_hash64(buf, 101, 8, &got);
    test_check(got != want, "the seed changes the digest");
    fsdp_hasher_free(h);
    test_check(fsdp_hash64(NULL, 5, 0, &got) == FSDP_ERR_INVALID && has("fsdp_hash64"), "hash64 of NULL");
    test_check(fsdp_hash64(buf, -1, 0, &got) == FSDP_ERR_INVALID, "hash64 of a negative length");
    test_check(fsdp_hasher_update(NULL, buf, 1) == FSDP_ERR_INVALID, "update of a NULL hasher");
}

static void check_files(const char *dir) {
    char path[512], sub[1024];
    snprintf(path, sizeof path, "%s/f.bin", dir);
    fsdp_file *f = NULL;
    test_check(fsdp_file_open(&f, path, FSDP_FILE_CREATE) == FSDP_OK, "create %s", path);
    test_check(fsdp_file_append(f, "hello", 5) == FSDP_OK && fsdp_file_append(f, " world", 6) == FSDP_OK, "append");
    test_check(fsdp_file_pwrite(f, "W", 1, 6) == FSDP_OK, "pwrite");
    test_check(fsdp_file_sync(f) == FSDP_OK && fsdp_file_close(f) == FSDP_OK, "sync and close");
    test_check(fsdp_file_open(&f, path, FSDP_FILE_READ) == FSDP_OK, "open for reading");
    int64_t size = -1, got = -1;
    char buf[32] = {0};
    test_check(fsdp_file_size(f, &size) == FSDP_OK && size == 11, "size 11 (got %lld)", (long long)size);
    test_check(fsdp_file_pread(f, buf, 32, 0, &got) == FSDP_OK && got == 11 && !memcmp(buf, "hello World", 11),
               "pread past the end is short and exact");
    test_check(fsdp_file_pread(f, buf, 4, 50, &got) == FSDP_OK && got == 0, "pread beyond the end reads nothing");
    test_check(fsdp_file_pwrite(f, "x", 1, 0) == FSDP_ERR_INVALID && has("open for reading") && has("f.bin"),
               "no write through a read handle: %s", fsdp_last_error());
    test_check(fsdp_file_pread(f, buf, -1, 0, &got) == FSDP_ERR_INVALID && has("bad range"), "negative length");
    test_check(fsdp_file_pread(f, NULL, 4, 0, &got) == FSDP_ERR_INVALID, "NULL buffer");
    fsdp_file_close(f);

    snprintf(sub, sizeof sub, "%s/no/such/dir/x.bin", dir);
    test_check(fsdp_file_open(&f, sub, FSDP_FILE_CREATE) == FSDP_ERR_IO && f == NULL && has("cannot create") &&
                   has("no/such/dir") && has("No such file"),
               "create in a missing folder: %s", fsdp_last_error());
    test_check(fsdp_file_open(&f, dir, FSDP_FILE_READ) == FSDP_ERR_IO && has("Is a directory"), "open a directory");
    test_check(fsdp_file_open(&f, path, 7) == FSDP_ERR_INVALID && has("unknown mode"), "unknown mode");
    test_check(fsdp_file_open(NULL, path, FSDP_FILE_READ) == FSDP_ERR_INVALID, "NULL out");
    test_check(fsdp_file_open(&f, "", FSDP_FILE_READ) == FSDP_ERR_INVALID && has("empty"), "empty path");

    snprintf(path, sizeof path, "%s/atomic.txt", dir);
    test_check(fsdp_file_write_atomic(path, "one", 3) == FSDP_OK && fsdp_file_write_atomic(path, "four", 4) == FSDP_OK,
               "write_atomic twice");
    fsdp_path_kind kind = FSDP_PATH_NONE;
    test_check(fsdp_path_stat(path, &kind, &size) == FSDP_OK && kind == FSDP_PATH_FILE && size == 4,
               "stat after write_atomic: a file of 4 bytes");
    snprintf(sub, sizeof sub, "%s.tmp", path);
    test_check(fsdp_path_stat(sub, &kind, NULL) == FSDP_OK && kind == FSDP_PATH_NONE, "no temporary left behind");
}

static void check_dirs(const char *dir) {
    char a[512], b[512];
    snprintf(a, sizeof a, "%s/t/u//v/", dir);
    test_check(fsdp_path_mkdirs(a) == FSDP_OK && fsdp_path_mkdirs(a) == FSDP_OK, "mkdirs, twice");
    const char *names[] = {"zeta", "Alpha", "beta", ".dot"};
    for (int i = 0; i < 4; i++) {
        snprintf(b, sizeof b, "%s/t/%s", dir, names[i]);
        fsdp_file_write_atomic(b, "x", 1);
    }
    snprintf(a, sizeof a, "%s/t", dir);
    fsdp_dir_listing *l = NULL;
    int64_t n = 0;
    test_check(fsdp_dir_list(&l, a) == FSDP_OK && fsdp_dir_listing_count(l, &n) == FSDP_OK && n == 5,
               "list: 5 names (got %lld)", (long long)n);
    const char *want[] = {".dot", "Alpha", "beta", "u", "zeta"};
    int sorted = 1;
    for (int64_t i = 0; i < n && i < 5; i++) {
        const char *name = NULL;
        fsdp_dir_listing_name(l, i, &name);
        if (!name || strcmp(name, want[i])) sorted = 0;
    }
    test_check(sorted, "list: sorted bytewise");
    const char *name = NULL;
    test_check(fsdp_dir_listing_name(l, 5, &name) == FSDP_ERR_INDEX, "list: index past the end");
    fsdp_dir_listing_free(l);
    snprintf(b, sizeof b, "%s/none", dir);
    test_check(fsdp_dir_list(&l, b) == FSDP_ERR_IO && l == NULL && has("cannot list directory") && has("none"),
               "list a missing folder");
    snprintf(b, sizeof b, "%s/t2", dir);
    test_check(fsdp_path_rename(a, b) == FSDP_OK, "rename a folder");
    test_check(fsdp_path_rename(a, b) == FSDP_ERR_IO && has("cannot rename"), "rename what is gone");
    test_check(fsdp_path_remove_tree(b) == FSDP_OK, "remove_tree");
    fsdp_path_kind kind = FSDP_PATH_FILE;
    test_check(fsdp_path_stat(b, &kind, NULL) == FSDP_OK && kind == FSDP_PATH_NONE, "the tree is gone");
    test_check(fsdp_path_remove_tree(b) == FSDP_OK, "remove_tree of nothing is fine");
    test_check(fsdp_path_remove_tree("/") == FSDP_ERR_INVALID && has("refusing"), "remove_tree refuses /");
    test_check(fsdp_path_remove_tree("./") == FSDP_ERR_INVALID, "remove_tree refuses .");
    snprintf(a, sizeof a, "%s/f.bin/sub", dir);
    test_check(fsdp_path_mkdirs(a) == FSDP_ERR_IO && has("cannot create directory"), "mkdirs through a file");
}

int main(void) {
    char dir[] = "/tmp/fsdp_test_io_XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    check_hash();
    check_files(dir);
    check_dirs(dir);
    test_check(fsdp_path_remove_tree(dir) == FSDP_OK, "clean up");
    return test_summary();
}
