/* A small JSON reader for the stand-in's node file: a tree of values, with line/column on a parse error. */
#ifndef GHDP_STANDIN_JSON_H
#define GHDP_STANDIN_JSON_H

#include <stddef.h>

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jval {
    jtype t;
    int b;               /* J_BOOL */
    int is_int;          /* J_NUM: written without fraction or exponent and in range */
    long long i;         /* J_NUM when is_int */
    double num;          /* J_NUM */
    char *s;             /* J_STR */
    int n;               /* J_ARR / J_OBJ: number of items */
    struct jval **items; /* J_ARR / J_OBJ */
    char **keys;         /* J_OBJ */
} jval;

#define JSON_HIDDEN __attribute__((visibility("hidden")))

/* NULL on error, with "line L, column C: what" in err. */
JSON_HIDDEN jval *json_parse(const char *text, size_t len, char *err, size_t errlen);
JSON_HIDDEN void json_free(jval *v);
/* Member of an object, or NULL when absent or when obj is not an object. */
JSON_HIDDEN const jval *json_get(const jval *obj, const char *key);

#endif
