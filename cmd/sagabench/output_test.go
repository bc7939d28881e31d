package main

import (
	"bytes"
	"context"
	"encoding/json"
	neturl "net/url"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// jsonKeys lists every key of a JSON object, nested ones as parent.key.
func jsonKeys(t *testing.T, raw []byte) []string {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(raw, &m))
	var keys []string
	var walk func(prefix string, m map[string]any)
	walk = func(prefix string, m map[string]any) {
		for k, v := range m {
			keys = append(keys, prefix+k)
			if sub, ok := v.(map[string]any); ok {
				walk(prefix+k+".", sub)
			}
		}
	}
	walk("", m)
	sort.Strings(keys)
	return keys
}

// helpText is the -h output.
func helpText(t *testing.T) string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-h"}, &stdout, &stderr))
	return stderr.String()
}

// assertDocumented checks that the -h text names every key (a nested one
// by its own name, under its parent's).
func assertDocumented(t *testing.T, help string, keys []string) {
	t.Helper()
	for _, k := range keys {
		leaf := k[strings.LastIndex(k, ".")+1:]
		assert.Regexp(t, `(^|[^a-z0-9_])`+regexp.QuoteMeta(leaf)+`($|[^a-z0-9_])`, help, "-h does not describe the JSON field %s", k)
	}
}

// -h describes every field of the JSON line, as BENCHMARKS.md says.
func TestHelpDescribesEveryJSONField(t *testing.T) {
	t.Parallel()
	raw, err := json.Marshal(result{})
	require.NoError(t, err)
	keys := jsonKeys(t, raw)
	require.Contains(t, keys, "config.consumers")
	assertDocumented(t, helpText(t), keys)
}

// Counts of one are singular.
func TestOneIsSingular(t *testing.T) {
	args := []string{"-sagas", "1", "-inflight", "1", "-rate", "1", "-duration", "1s",
		"-consumers", "1", "-workers", "1", "-baseline", "0", "-idle", "0"}
	takeTurn(t, args) // a real run takes many connections
	t.Setenv("DATABASE_URL", testdb.Shared(t).URL)
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	require.Equal(t, exitOK, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	all := stdout.String() + stderr.String()
	plural := regexp.MustCompile(`\b1 (sagas|consumers|workers|lanes|customers|messages|cores)\b([^/]|$)`) // "sagas/s" is a unit
	assert.Empty(t, plural.FindAllString(all, -1), all)
	assert.Contains(t, all, "1 consumer a handler, 1 worker")
}

// Nothing the program prints shows the database password, whatever form
// the connection string takes. (The server trusts local connections, so
// the password is never checked.)
func TestNoPasswordInOutput(t *testing.T) {
	args := []string{"-sagas", "5", "-inflight", "4", "-rate", "0", "-baseline", "200ms", "-idle", "0", "-consumers", "1"}
	need := takeTurn(t, args) // real runs take many connections
	const secret = `s3cr3t w'0rd`
	escaped := strings.ReplaceAll(neturl.QueryEscape(secret), "+", "%20") // libpq and pgx decode %XX, not +
	role := testdb.Role(t, -1, secret)                                    // the server checks the password, or trusts and ignores it
	for name, url := range map[string]string{
		"url userinfo":   role,
		"url query":      testdb.WithoutPassword(t, role) + "&password=" + escaped,
		"keyword quoted": testdb.Keywords(t, role) + ` password='s3cr3t w\'0rd'`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("DATABASE_URL", url)
			var stdout, stderr bytes.Buffer
			testdb.FreeConnections(t, need) // the run before it may still be closing
			code := run(context.Background(), args, &stdout, &stderr)
			all := stdout.String() + stderr.String()
			assert.Equal(t, exitOK, code, all)
			assert.NotContains(t, all, "s3cr3t")
			assert.NotContains(t, all, "0rd")
			assert.NotContains(t, all, escaped)
		})
	}
}
