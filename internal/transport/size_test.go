package transport_test

import (
	"bytes"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/transport"
)

// A message larger than MaxMessageBytes (payload and metadata) is refused
// at publish, permanently, with nothing of the publish written: the
// message that fits before it is not queued either. One at the limit is
// published. (Nothing capped a message's size: a 100 MB message cost every
// worker that claimed it several times that in memory.)
func TestAMessageLargerThanTheCapIsRefusedAtPublish(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *transport.Config) { c.MaxMessageBytes = 1000 })
	atLimit := message.NewMessage(uuid.NewString(), bytes.Repeat([]byte("a"), 990))
	atLimit.Metadata.Set("k", "123456789") // 1 + 9 bytes: 1000 in all
	over := message.NewMessage(uuid.NewString(), bytes.Repeat([]byte("a"), 990))
	over.Metadata.Set("k", "1234567890")

	err := e.tr.Publisher(e.db.SQL).Publish(e.in, atLimit, over)
	require.ErrorIs(t, err, transport.ErrMessageTooLarge)
	assert.True(t, transport.IsPermanent(err))
	assert.Contains(t, err.Error(), "1001 bytes, the limit is 1000")
	assert.Zero(t, e.waiting(e.in, "g"), "nothing of the publish is written")

	require.NoError(t, e.tr.Publisher(e.db.SQL).Publish(e.in, atLimit))
	assert.Equal(t, 1, e.waiting(e.in, "g"))

	_, err = transport.New(transport.Config{DB: e.db.SQL, MaxMessageBytes: -1})
	assert.ErrorContains(t, err, "MaxMessageBytes")
}
