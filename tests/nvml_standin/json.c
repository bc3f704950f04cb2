#include "json.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *p, *start, *end;
    char *err;
    size_t errlen;
    int failed;
    int depth;
} parser;

static void fail(parser *ps, const char *what)
{
    if (ps->failed)
        return;
    ps->failed = 1;
    int line = 1, col = 1;
    for (const char *q = ps->start; q < ps->p && q < ps->end; q++) {
        if (*q == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    snprintf(ps->err, ps->errlen, "line %d, column %d: %s", line, col, what);
}

static void skip_ws(parser *ps)
{
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static jval *new_val(jtype t)
{
    jval *v = calloc(1, sizeof *v);
    if (v)
        v->t = t;
    return v;
}

void json_free(jval *v)
{
    if (!v)
        return;
    for (int k = 0; k < v->n; k++) {
        json_free(v->items[k]);
        if (v->keys)
            free(v->keys[k]);
    }
    free(v->items);
    free(v->keys);
    free(v->s);
    free(v);
}

static jval *parse_value(parser *ps);

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static void put_utf8(char *out, size_t *n, unsigned cp)
{
    if (cp < 0x80) {
        out[(*n)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*n)++] = (char)(0xC0 | (cp >> 6));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out[(*n)++] = (char)(0xE0 | (cp >> 12));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        out[(*n)++] = (char)(0xF0 | (cp >> 18));
        out[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static char *parse_string_raw(parser *ps)
{
    /* ps->p is at the opening quote; the decoded text is never longer than the encoded one. */
    ps->p++;
    const char *q = ps->p;
    size_t cap = 0;
    while (q < ps->end && *q != '"') {
        if (*q == '\\')
            q++;
        q++;
        cap++;
    }
    char *out = malloc(cap * 4 + 1);
    if (!out) {
        fail(ps, "out of memory");
        return NULL;
    }
    size_t n = 0;
    while (1) {
        if (ps->p >= ps->end) {
            fail(ps, "unterminated string");
            free(out);
            return NULL;
        }
        unsigned char c = (unsigned char)*ps->p;
        if (c == '"') {
            ps->p++;
            break;
        }
        if (c < 0x20) {
            fail(ps, "control character in string");
            free(out);
            return NULL;
        }
        if (c != '\\') {
            out[n++] = (char)c;
            ps->p++;
            continue;
        }
        ps->p++;
        if (ps->p >= ps->end) {
            fail(ps, "unterminated string");
            free(out);
            return NULL;
        }
        char e = *ps->p++;
        switch (e) {
        case '"': out[n++] = '"'; break;
        case '\\': out[n++] = '\\'; break;
        case '/': out[n++] = '/'; break;
        case 'b': out[n++] = '\b'; break;
        case 'f': out[n++] = '\f'; break;
        case 'n': out[n++] = '\n'; break;
        case 'r': out[n++] = '\r'; break;
        case 't': out[n++] = '\t'; break;
        case 'u': {
            unsigned cp = 0;
            for (int k = 0; k < 4; k++) {
                int h = ps->p < ps->end ? hexval(*ps->p) : -1;
                if (h < 0) {
                    fail(ps, "bad \\u escape");
                    free(out);
                    return NULL;
                }
                cp = cp * 16 + (unsigned)h;
                ps->p++;
            }
            put_utf8(out, &n, cp);
            break;
        }
        default:
            ps->p--;
            fail(ps, "bad escape in string");
            free(out);
            return NULL;
        }
    }
    out[n] = '\0';
    return out;
}

static jval *parse_number(parser *ps)
{
    const char *s = ps->p;
    int integral = 1;
    if (ps->p < ps->end && *ps->p == '-')
        ps->p++;
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9') {
        fail(ps, "expected a value");
        return NULL;
    }
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
        ps->p++;
    if (ps->p < ps->end && *ps->p == '.') {
        integral = 0;
        ps->p++;
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
            ps->p++;
    }
    if (ps->p < ps->end && (*ps->p == 'e' || *ps->p == 'E')) {
        integral = 0;
        ps->p++;
        if (ps->p < ps->end && (*ps->p == '+' || *ps->p == '-'))
            ps->p++;
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
            ps->p++;
    }
    char buf[64];
    size_t len = (size_t)(ps->p - s);
    if (len >= sizeof buf) {
        fail(ps, "number too long");
        return NULL;
    }
    memcpy(buf, s, len);
    buf[len] = '\0';
    jval *v = new_val(J_NUM);
    if (!v) {
        fail(ps, "out of memory");
        return NULL;
    }
    v->num = strtod(buf, NULL);
    if (integral) {
        errno = 0;
        v->i = strtoll(buf, NULL, 10);
        v->is_int = errno == 0;
    }
    return v;
}

static int literal(parser *ps, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) >= n && memcmp(ps->p, word, n) == 0) {
        ps->p += n;
        return 1;
    }
    return 0;
}

static int push(jval *v, jval *item, char *key)
{
    jval **items = realloc(v->items, (size_t)(v->n + 1) * sizeof *items);
    if (!items)
        return 0;
    v->items = items;
    if (v->t == J_OBJ) {
        char **keys = realloc(v->keys, (size_t)(v->n + 1) * sizeof *keys);
        if (!keys)
            return 0;
        v->keys = keys;
        v->keys[v->n] = key;
    }
    v->items[v->n++] = item;
    return 1;
}

static jval *parse_container(parser *ps, int is_obj)
{
    jval *v = new_val(is_obj ? J_OBJ : J_ARR);
    if (!v) {
        fail(ps, "out of memory");
        return NULL;
    }
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == (is_obj ? '}' : ']')) {
        ps->p++;
        return v;
    }
    while (1) {
        char *key = NULL;
        skip_ws(ps);
        if (is_obj) {
            if (ps->p >= ps->end || *ps->p != '"') {
                fail(ps, "expected a string key");
                break;
            }
            key = parse_string_raw(ps);
            if (!key)
                break;
            for (int k = 0; k < v->n; k++) {
                if (strcmp(v->keys[k], key) == 0) {
                    fail(ps, "duplicate key");
                    break;
                }
            }
            skip_ws(ps);
            if (ps->failed || ps->p >= ps->end || *ps->p != ':') {
                fail(ps, "expected ':'");
                free(key);
                break;
            }
            ps->p++;
        }
        jval *item = parse_value(ps);
        if (!item) {
            free(key);
            break;
        }
        if (!push(v, item, key)) {
            json_free(item);
            free(key);
            fail(ps, "out of memory");
            break;
        }
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') {
            ps->p++;
            continue;
        }
        if (ps->p < ps->end && *ps->p == (is_obj ? '}' : ']')) {
            ps->p++;
            return v;
        }
        fail(ps, is_obj ? "expected ',' or '}'" : "expected ',' or ']'");
        break;
    }
    json_free(v);
    return NULL;
}

static jval *parse_value(parser *ps)
{
    skip_ws(ps);
    if (ps->p >= ps->end) {
        fail(ps, "unexpected end of input");
        return NULL;
    }
    if (++ps->depth > 64) {
        fail(ps, "nested too deeply");
        return NULL;
    }
    jval *v = NULL;
    char c = *ps->p;
    if (c == '{' || c == '[') {
        v = parse_container(ps, c == '{');
    } else if (c == '"') {
        char *s = parse_string_raw(ps);
        if (s) {
            v = new_val(J_STR);
            if (v)
                v->s = s;
            else
                free(s);
        }
    } else if (literal(ps, "true") || literal(ps, "false")) {
        v = new_val(J_BOOL);
        if (v)
            v->b = ps->p[-1] == 'e' && ps->p[-2] == 'u';
    } else if (literal(ps, "null")) {
        v = new_val(J_NULL);
    } else {
        v = parse_number(ps);
    }
    ps->depth--;
    return v;
}

jval *json_parse(const char *text, size_t len, char *err, size_t errlen)
{
    parser ps = {text, text, text + len, err, errlen, 0, 0};
    jval *v = parse_value(&ps);
    if (v) {
        skip_ws(&ps);
        if (ps.p != ps.end) {
            fail(&ps, "trailing characters after the document");
            json_free(v);
            v = NULL;
        }
    }
    return v;
}

const jval *json_get(const jval *obj, const char *key)
{
    if (!obj || obj->t != J_OBJ)
        return NULL;
    for (int k = 0; k < obj->n; k++) {
        if (strcmp(obj->keys[k], key) == 0)
            return obj->items[k];
    }
    return NULL;
}
