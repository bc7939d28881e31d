package saga_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
)

// Listing sagas does not read their data, whatever its size: it says how
// large it is and how it begins; Get reads it whole. (Listing 33 sagas of
// 10 MB each took 451 MB.)
func TestListReadsASizeAndAPreviewNotTheData(t *testing.T) {
	t.Parallel()
	c, def, db := newSignupClient(t)
	startRunning(t, c)
	signUp(t, c, def, "big@example.com", true)
	waitFinished(t, c, def, "big@example.com")
	_, err := db.SQL.Exec(`UPDATE saga_instances SET data = jsonb_build_object('email', repeat('x', 1 << 20))`)
	require.NoError(t, err)
	want := `{"email": "` + strings.Repeat("x", 1<<20) + `"}`

	list, err := c.List(context.Background(), saga.Filter{})
	require.NoError(t, err)
	require.Len(t, list, 1)
	assert.Nil(t, list[0].Data, "not read")
	assert.Equal(t, len(want), list[0].DataBytes)
	assert.Equal(t, want[:saga.DataPreviewChars], list[0].DataPreview)

	in, err := c.Get(context.Background(), list[0].ID)
	require.NoError(t, err)
	assert.Equal(t, want, string(in.Data))
	assert.Equal(t, len(want), in.DataBytes)
}

// Pages of a listing (Filter.After: the last of the previous page) read
// every instance once, in List's order, even when all were updated at
// the same moment (then by id).
func TestListPagesThroughEveryInstanceOnce(t *testing.T) {
	t.Parallel()
	c, def, db := newSignupClient(t)
	startRunning(t, c)
	for i := range 5 {
		signUp(t, c, def, fmt.Sprintf("page%d@example.com", i), true)
	}
	for i := range 5 {
		waitFinished(t, c, def, fmt.Sprintf("page%d@example.com", i))
	}
	_, err := db.SQL.Exec(`UPDATE saga_instances SET updated_at = now()`)
	require.NoError(t, err)
	all, err := c.List(context.Background(), saga.Filter{})
	require.NoError(t, err)
	require.Len(t, all, 5)

	var paged []uuid.UUID
	f := saga.Filter{Limit: 2}
	for range 4 {
		page, err := c.List(context.Background(), f)
		require.NoError(t, err)
		for _, in := range page {
			paged = append(paged, in.ID)
		}
		if len(page) < f.Limit {
			break
		}
		f.After = &page[len(page)-1]
	}
	want := make([]uuid.UUID, len(all))
	for i, in := range all {
		want[i] = in.ID
	}
	assert.Equal(t, want, paged, "every instance once, in order")
}
