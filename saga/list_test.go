package saga_test

import (
	"context"
	"strings"
	"testing"

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
