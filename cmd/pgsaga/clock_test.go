package main

import (
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// Ages of sagas are told on the database's clock, which set their times:
// with the database an hour ahead of this machine, a saga started just now
// is seconds old, not an hour in the future (the listing used the local
// clock).
func TestAgesAreOnTheDatabasesClock(t *testing.T) {
	srv := testdb.StartPrivateSkewed(t, time.Hour)
	t.Setenv("DATABASE_URL", srv.URL)
	code, _, errOut := pgsaga(t, "migrate")
	require.Equal(t, exitOK, code, errOut)
	db, err := pgdb.Open(t.Context(), pgdb.Config{URL: srv.URL})
	require.NoError(t, err)
	t.Cleanup(db.Close)
	id := uuid.New()
	_, err = db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step)
		VALUES ($1, 'job', 1, 'running', '{}', 0)`, id)
	require.NoError(t, err)

	code, out, errOut := pgsaga(t, "sagas", "--json")
	require.Equal(t, exitOK, code, errOut)
	var list []sagaJSON
	require.NoError(t, json.Unmarshal([]byte(out), &list))
	require.Len(t, list, 1)
	assert.InDelta(t, 0, list[0].AgeS, 60, "age by the database's clock")

	code, out, errOut = pgsaga(t, "show", id.String(), "--json")
	require.Equal(t, exitOK, code, errOut)
	var one sagaJSON
	require.NoError(t, json.Unmarshal([]byte(out), &one))
	assert.InDelta(t, 0, one.AgeS, 60, "age by the database's clock")

	// Dead letters too: in the listing, its JSON, one shown whole, and the
	// web view's pages.
	dl := insertDeadLetter(t, db.SQL, sqlDeadLetter{Topic: "clock.topic", Group: "clock.group", Reason: "skewed"})
	code, out, errOut = pgsaga(t, "dead-letters")
	require.Equal(t, exitOK, code, errOut)
	assertAgesNotNegative(t, out, "pgsaga dead-letters")
	code, out, errOut = pgsaga(t, "dead-letters", "show", strconv.FormatInt(dl, 10))
	require.Equal(t, exitOK, code, errOut)
	assertAgesNotNegative(t, out, "pgsaga dead-letters show")
	code, out, errOut = pgsaga(t, "dead-letters", "--json")
	require.Equal(t, exitOK, code, errOut)
	var dead []deadLetterJSON
	require.NoError(t, json.Unmarshal([]byte(out), &dead))
	require.Len(t, dead, 1)
	assert.InDelta(t, 0, dead[0].DeadAgeS, 60, "dead_age_s by the database's clock")

	b := serveTestUI(t, srv.URL, uiConfig{}, uiServing{}).browser(t)
	for _, path := range []string{"/dead-letters", "/dead-letters/" + strconv.FormatInt(dl, 10)} {
		page := b.get(path)
		require.Equal(t, http.StatusOK, page.status, path)
		assertAgesNotNegative(t, page.body, path)
	}
}

// assertAgesNotNegative fails if out tells an age ("… ago") that is
// negative, or tells none.
func assertAgesNotNegative(t *testing.T, out, what string) {
	t.Helper()
	assert.Regexp(t, `(^|[^-0-9])[0-9]+(ms|s|m[0-9]+s) ago`, out, "%s tells an age", what)
	assert.NotRegexp(t, `-[0-9]+(ms|s|m[0-9]+s|h[0-9]+m) ago`, out, "%s tells a negative age", what)
}
