package main

import (
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga"
)

// The dead letters listing reads a bounded part of each (ten of 2 MiB make
// a listing of a few kB): sizes, a preview, the reason's length; payload
// holds the whole payload only when the preview is all of it. show reads
// one whole, and --payload-out writes its payload's bytes as they are.
func TestDeadLettersListingIsBoundedAndShowIsWhole(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	_, err := db.SQL.Exec(`INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
		SELECT 'big-' || i, 'big.topic', 'g', 'h', convert_to(repeat('x', 2 * 1024 * 1024 - 1) || i % 10, 'UTF8'), '{}', repeat('r', 5000), 5, now()
		FROM generate_series(1, 10) AS i`)
	require.NoError(t, err)
	small := insertDeadLetter(t, db.SQL, sqlDeadLetter{UUID: "small", Topic: "small.topic", Group: "g", Payload: []byte("lost"), Reason: "no group", Metadata: map[string]string{"k": "v"}})
	binary := insertDeadLetter(t, db.SQL, sqlDeadLetter{UUID: "binary", Topic: "small.topic", Group: "g", Payload: []byte{0xff, 0x00, 'a'}, Reason: "unreadable", Metadata: map[string]string{"k": "v"}})

	code, out, errOut := pgsaga(t, "dead-letters", "--json")
	require.Equal(t, exitOK, code, errOut)
	assert.Less(t, len(out), 200_000, "a listing of ten 2 MiB dead letters")
	var list []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &list))
	require.Len(t, list, 12)
	big := list[0]
	assert.Nil(t, big["payload"], "not all of the payload is listed")
	assert.EqualValues(t, 2*1024*1024, big["payload_size"])
	assert.Equal(t, false, big["payload_complete"])
	assert.Equal(t, strings.Repeat("x", 256), big["payload_preview"])
	assert.EqualValues(t, 5000, big["reason_length"])
	assert.Len(t, big["reason"], 4096)
	assert.EqualValues(t, 2, big["metadata_size"])
	byUUID := map[string]map[string]any{}
	for _, d := range list {
		byUUID[d["uuid"].(string)] = d
	}
	assert.Equal(t, "lost", byUUID["small"]["payload"])
	assert.Equal(t, true, byUUID["small"]["payload_complete"])
	assert.Nil(t, byUUID["binary"]["payload"], "bytes that are not text are not given as text")
	assert.Equal(t, base64.StdEncoding.EncodeToString([]byte{0xff, 0x00, 'a'}), byUUID["binary"]["payload_preview_base64"])

	code, out, errOut = pgsaga(t, "dead-letters")
	require.Equal(t, exitOK, code, errOut)
	assert.Less(t, len(out), 20_000)
	assert.Contains(t, out, "2.0 MiB")

	id := strconv.FormatInt(int64(big["id"].(float64)), 10)
	code, out, errOut = pgsaga(t, "dead-letters", "show", id, "--json")
	require.Equal(t, exitOK, code, errOut)
	var whole map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &whole))
	assert.Len(t, whole["payload"], 2*1024*1024)
	assert.Equal(t, true, whole["payload_complete"])
	assert.Len(t, whole["reason"], 5000)
	code, out, errOut = pgsaga(t, "dead-letters", "show", id)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, strings.Repeat("x", 100_000), "the payload, whole")
	assert.Contains(t, out, strings.Repeat("r", 5000), "the reason, whole")

	file := filepath.Join(t.TempDir(), "payload")
	code, out, errOut = pgsaga(t, "dead-letters", "show", strconv.FormatInt(binary, 10), "--payload-out", file)
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "3 bytes written to "+file)
	got, err := os.ReadFile(file)
	require.NoError(t, err)
	assert.Equal(t, []byte{0xff, 0x00, 'a'}, got)
	code, _, errOut = pgsaga(t, "dead-letters", "show", strconv.FormatInt(binary, 10), "--payload-out", file)
	assert.Equal(t, exitFailed, code, "an existing file is not overwritten: %s", errOut)
	code, out, errOut = pgsaga(t, "dead-letters", "show", strconv.FormatInt(small, 10), "--payload-out", "-")
	require.Equal(t, exitOK, code, errOut)
	assert.Equal(t, "lost", out, "the payload alone, on stdout")

	code, _, errOut = pgsaga(t, "dead-letters", "show", "999999")
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "no such dead letter")
}

// dead-letters delete deletes the dead letters it names, or those of a
// topic dead for longer than --older-than; without --yes it says how many
// it would delete and deletes none (exit 2).
func TestDeadLettersDelete(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	a := insertDeadLetter(t, db.SQL, sqlDeadLetter{UUID: "a", Topic: "t.one", Group: "g", Payload: []byte("a"), Reason: "r", Metadata: map[string]string{"k": "v"}})
	b := insertDeadLetter(t, db.SQL, sqlDeadLetter{UUID: "b", Topic: "t.one", Group: "g", Payload: []byte("b"), Reason: "r", Metadata: map[string]string{"k": "v"}})
	old := insertDeadLetter(t, db.SQL, sqlDeadLetter{UUID: "old", Topic: "t.one", Group: "g", Payload: []byte("old"), Reason: "r", Metadata: map[string]string{"k": "v"}})
	otherOld := insertDeadLetter(t, db.SQL, sqlDeadLetter{UUID: "other-old", Topic: "t.two", Group: "g", Payload: []byte("other"), Reason: "r", Metadata: map[string]string{"k": "v"}})
	_, err := db.SQL.Exec(`UPDATE pgsaga_dead_letters SET dead_at = now() - interval '2 days' WHERE id = ANY ($1)`, []int64{old, otherOld})
	require.NoError(t, err)
	remaining := func() []int64 {
		rows, err := db.SQL.Query(`SELECT id FROM pgsaga_dead_letters ORDER BY id`)
		require.NoError(t, err)
		defer rows.Close()
		var ids []int64
		for rows.Next() {
			var id int64
			require.NoError(t, rows.Scan(&id))
			ids = append(ids, id)
		}
		return ids
	}
	s := func(id int64) string { return strconv.FormatInt(id, 10) }

	code, _, errOut := pgsaga(t, "dead-letters", "delete", s(a))
	assert.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, "deletes 1 dead letter")
	code, _, errOut = pgsaga(t, "dead-letters", "delete", "--topic", "t.one", "--older-than", "24h")
	assert.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, "deletes 1 dead letter")
	assert.Equal(t, []int64{a, b, old, otherOld}, remaining())

	code, out, errOut := pgsaga(t, "dead-letters", "delete", "--topic", "t.one", "--older-than", "24h", "--yes")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "1 dead letter deleted")
	assert.Equal(t, []int64{a, b, otherOld}, remaining(), "only those of the topic, only those older")

	code, out, errOut = pgsaga(t, "dead-letters", "delete", s(a), s(b), "--yes")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "2 dead letters deleted")
	assert.Equal(t, []int64{otherOld}, remaining())
	code, _, errOut = pgsaga(t, "dead-letters", "delete", s(a), "--yes")
	assert.Equal(t, exitFailed, code, "deleted already: %s", errOut)

	for _, args := range [][]string{
		{"dead-letters", "delete"}, {"dead-letters", "delete", "--topic", "t.two", "--yes"}, {"dead-letters", "delete", "--older-than", "1h", "--yes"},
		{"dead-letters", "delete", "x", "--yes"}, {"dead-letters", "delete", s(otherOld), "--topic", "t.two", "--older-than", "1h", "--yes"},
		{"dead-letters", "delete", "--topic", "t.two", "--older-than", "0s", "--yes"},
	} {
		code, _, errOut = pgsaga(t, args...)
		assert.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
	assert.Equal(t, []int64{otherOld}, remaining())
}

// hostile is text a foreign publisher or a careless writer can store: it
// clears the screen, turns it red, rings the bell and reverses what
// follows.
const hostile = "evil\x1b[2J\x1b[31m\a\u202eexe.txt\u009b\x7f"

// rawControls reports the first terminal control in s, if any.
func rawControls(s string) string {
	for _, bad := range []string{"\x1b", "\a", "\u202e", "\u009b", "\x7f"} {
		if strings.Contains(s, bad) {
			return strconv.Quote(bad)
		}
	}
	return ""
}

// Every human-readable output escapes what would act on a terminal (a
// message id, a reason, a saga's type, step and failure reason holding
// escape sequences, a bell, a bidi override); JSON output keeps every
// character as stored, escaped as JSON.
func TestOutputIsSafeOnATerminal(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	sagaID := uuid.New()
	_, err := db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step, failure_reason, correlation_id)
		VALUES ($1, $2, 1, 'running', '{}', 0, $2, $2)`, sagaID, hostile)
	require.NoError(t, err)
	_, err = db.SQL.Exec(`INSERT INTO saga_history (saga_id, seq, kind, step, phase, attempt, message_id, detail) VALUES ($1, 1, $2, $2, 'action', 1, $2, $2)`, sagaID, hostile)
	require.NoError(t, err)
	dl := insertDeadLetter(t, db.SQL, sqlDeadLetter{UUID: hostile, Topic: "hostile.topic", Group: "g", Payload: []byte(hostile), Reason: hostile, Metadata: map[string]string{"k": "v"}})
	_, err = db.SQL.Exec(`INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES ($1, $1)`, hostile)
	require.NoError(t, err)

	for _, args := range [][]string{
		{"sagas"}, {"show", sagaID.String()}, {"dead-letters"}, {"dead-letters", "show", strconv.FormatInt(dl, 10)},
		{"dead-letters", "replay", strconv.FormatInt(dl, 10)}, {"consumers"}, {"cancel", sagaID.String(), "--no-wait"},
		{"sagas", "--saga", hostile}, {"no-such-command" + hostile}, {"sagas", "--" + hostile},
	} {
		_, out, errOut := pgsaga(t, args...)
		assert.Empty(t, rawControls(out), "%q: stdout: %s", args, out)
		assert.Empty(t, rawControls(errOut), "%q: stderr: %s", args, errOut)
	}
	_, out, _ := pgsaga(t, "show", sagaID.String())
	assert.Contains(t, out, `evil\x1b[2J\x1b[31m\x07\u202eexe.txt\u009b\x7f`, "escaped, not dropped")
	_, out, _ = pgsaga(t, "dead-letters", "show", strconv.FormatInt(dl, 10))
	assert.Contains(t, out, `evil\x1b[2J`)

	for _, args := range [][]string{{"sagas", "--json"}, {"show", sagaID.String(), "--json"}, {"dead-letters", "--json"}, {"dead-letters", "show", strconv.FormatInt(dl, 10), "--json"}, {"consumers", "--json"}} {
		code, out, errOut := pgsaga(t, args...)
		require.Equal(t, exitOK, code, "%v: %s", args, errOut)
		assert.Empty(t, rawControls(out), "%v", args)
		assert.Contains(t, out, `\u001b[2J`, "%v", args)
		var v any
		require.NoError(t, json.Unmarshal([]byte(out), &v))
		assert.True(t, containsString(v, hostile), "%v: the text as stored: %s", args, out)
	}
}

// containsString reports whether the decoded JSON v holds s as a value.
func containsString(v any, s string) bool {
	switch v := v.(type) {
	case string:
		return v == s
	case []any:
		for _, e := range v {
			if containsString(e, s) {
				return true
			}
		}
	case map[string]any:
		for _, e := range v {
			if containsString(e, s) {
				return true
			}
		}
	}
	return false
}

// A value no name or text can be (bytes that are not UTF-8, a NUL) is a
// bad command line, exit 2, and the message names it without its bytes.
func TestInvalidValuesAreUsageErrors(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	id := uuid.NewString()
	for _, args := range [][]string{
		{"sagas", "--saga", "\xff"}, {"sagas", "--saga", "a\x00b"}, {"dead-letters", "--topic", "\xff"},
		{"cancel", id, "--reason", "\xff"}, {"cancel", id, "--reason", "a\x00b"}, {"consumers", "drop", "g", "--topic", "\xff"},
		{"dead-letters", "delete", "--topic", "\xff", "--older-than", "1h"}, {"cancel", "--saga", "\xff", "--yes"},
		{"show", "\xff"}, {"dead-letters", "show", "\xff"}, {"consumers", "drop", "\xff"},
	} {
		code, out, errOut := pgsaga(t, args...)
		assert.Equal(t, exitUsage, code, "%q: %s", args, errOut)
		assert.False(t, strings.ContainsAny(out+errOut, "\x00") || strings.Contains(out+errOut, "\xff"), "%q: the raw bytes echoed: %q", args, errOut)
	}
}

// show finds a saga by its name and business key as well as by its id;
// an unknown key exits 1 saying so, a command line that gives both ways,
// or half of one, exits 2.
func TestShowBySagaNameAndKey(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	id := insertSaga(t, db.SQL, sqlSaga{Type: "order", Step: "charge", Status: saga.StatusRunning, ID: saga.ID("order", "o-42")})

	code, out, errOut := pgsaga(t, "show", "--saga", "order", "--key", "o-42")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "saga      "+id.String()+" (order v1)")
	byID, _, _ := pgsaga(t, "show", id.String())
	_, same, _ := pgsaga(t, "show", id.String())
	assert.Equal(t, exitOK, byID)
	assert.Equal(t, same, out, "the same page as by its id")

	code, _, errOut = pgsaga(t, "show", "--saga", "order", "--key", "o-43")
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "no saga order has the key o-43")
	for _, args := range [][]string{
		{"show", id.String(), "--saga", "order", "--key", "o-42"},
		{"show", "--saga", "order"},
		{"show", "--key", "o-42"},
		{"show", "--saga", "", "--key", "o-42"},
		{"show", "--saga", "order", "--key", "a\x00b"},
		{"show"},
	} {
		code, _, errOut := pgsaga(t, args...)
		assert.Equal(t, exitUsage, code, "%q: %s", args, errOut)
		assert.NotContains(t, errOut, "\x00", "nothing unprintable echoed")
	}
}
