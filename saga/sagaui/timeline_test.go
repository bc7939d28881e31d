package sagaui

import (
	"bytes"
	"encoding/xml"
	"errors"
	"html/template"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
)

var t0 = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func at(ms float64) time.Time { return t0.Add(time.Duration(ms * float64(time.Millisecond))) }

func entry(ms float64, kind, step string, phase saga.Phase, attempt int) saga.HistoryEntry {
	return saga.HistoryEntry{At: at(ms), Kind: kind, Step: step, Phase: phase, Attempt: attempt}
}

// What the real runs of the other tests do not produce: a deadline, a
// command sent again, an action given up on; each drawn where it happened.
func TestTimelinePictureOfEveryKindOfEntry(t *testing.T) {
	const (
		act  = saga.PhaseAction
		comp = saga.PhaseCompensation
	)
	finished := at(900)
	in := saga.Instance{ID: uuid.New(), Status: saga.StatusCompensated, CreatedAt: t0, FinishedAt: &finished, History: []saga.HistoryEntry{
		entry(1, "started", "", "", 0),
		entry(2, "sent", "reserve", act, 1),
		entry(40, "reply_ok", "reserve", act, 1),
		entry(41, "sent", "ship", act, 1),
		entry(300, "deadline", "ship", act, 1),
		entry(300, "resent", "ship", act, 2),
		entry(600, "gave_up", "ship", act, 2),
		entry(600, "sent", "ship", comp, 1),
		entry(700, "reply_ok", "ship", comp, 1),
		entry(700, "sent", "reserve", comp, 1),
		entry(890, "reply_ok", "reserve", comp, 1),
		entry(890, "compensated", "", "", 0),
	}}
	tl := buildTimeline(in, at(5000))
	require.NotNil(t, tl)

	var lanes []string
	for _, l := range tl.Lanes {
		lanes = append(lanes, l.Name)
	}
	assert.Equal(t, []string{"reserve", "ship"}, lanes, "in the order the timeline names the steps")
	type bar struct{ step, phase, outcome, label string }
	var got []bar
	for _, b := range tl.Bars {
		got = append(got, bar{b.Step, b.Phase, b.Outcome, b.Label})
	}
	assert.Equal(t, []bar{
		{"reserve", "action", "ok", "38.0 ms"},
		{"ship", "action", "gave_up", "559.0 ms · 2 sends"},
		{"ship", "compensation", "ok", "100.0 ms"},
		{"reserve", "compensation", "ok", "190.0 ms"},
	}, got)
	var marks []string
	for _, m := range tl.Marks {
		marks = append(marks, m.Kind)
	}
	assert.Equal(t, []string{"deadline", "resent"}, marks)
	require.Len(t, tl.Events, 2)
	assert.Equal(t, "started", tl.Events[0].Kind)
	assert.Equal(t, "compensated +890.0 ms", tl.Events[1].Label)

	// Geometry: time runs left to right over the plot, a compensation is
	// drawn on its lane's lower row, the axis counts milliseconds.
	b := tl.Bars
	assert.InDelta(t, tlPlotLeft+2/918.0*(tlPlotRight-tlPlotLeft), b[0].X, 0.01)
	assert.Less(t, b[0].X+b[0].W, b[1].X)
	assert.Equal(t, tl.Lanes[1].CompY, b[2].Y)
	assert.Equal(t, tl.Lanes[1].ActionY, b[1].Y)
	assert.Greater(t, b[2].Y, b[1].Y)
	assert.LessOrEqual(t, b[3].X+b[3].W, tlPlotRight)
	var ticks []string
	for _, tk := range tl.Ticks {
		ticks = append(ticks, tk.Label)
	}
	assert.Equal(t, []string{"0", "200", "400", "600", "800"}, ticks)
	assert.Equal(t, "time since the saga started (ms)", tl.AxisTitle)
	assert.NotEmpty(t, b[0].EndPath, "a reply is marked at the bar's end")

	// Drawn: well-formed SVG with a group per lane and per bar.
	svg := renderTimeline(t, tl)
	assert.Equal(t, 2, strings.Count(svg, `<g class="lane"`))
	assert.Equal(t, 4, strings.Count(svg, `<g class="bar-group"`))
	assert.Contains(t, svg, `class="mark mark-deadline"`)
	assert.Contains(t, svg, `class="mark mark-resent"`)
	assert.Contains(t, svg, `data-outcome="gave_up"`)
}

// A command not answered yet runs to now, hatched; a long saga's axis is in
// larger units; a step name is text, never markup.
func TestTimelinePictureOfARunningSaga(t *testing.T) {
	in := saga.Instance{ID: uuid.New(), Status: saga.StatusRunning, CreatedAt: t0, History: []saga.HistoryEntry{
		entry(1, "started", "", "", 0),
		entry(3, "sent", "<b>step</b>", saga.PhaseAction, 1),
	}}
	tl := buildTimeline(in, at(25*60_000))
	require.Len(t, tl.Bars, 1)
	assert.Equal(t, "open", tl.Bars[0].Outcome)
	assert.Empty(t, tl.Bars[0].EndPath)
	assert.InDelta(t, tlPlotLeft+(tlPlotRight-tlPlotLeft)/1.02, tl.Bars[0].X+tl.Bars[0].W, 0.5, "to now")
	assert.Equal(t, "time since the saga started (min)", tl.AxisTitle)
	svg := renderTimeline(t, tl)
	assert.Contains(t, svg, "bar-open")
	assert.Contains(t, svg, "&lt;b&gt;step&lt;/b&gt;")
	assert.NotContains(t, svg, "<b>")

	assert.Nil(t, buildTimeline(saga.Instance{Status: saga.StatusCompleted, CreatedAt: t0}, at(1)), "no timeline, no picture")
}

func renderTimeline(t *testing.T, tl *svgTimeline) string {
	t.Helper()
	tmpl, err := template.New("").Funcs(templateFuncs).ParseFS(webFS, "web/timeline.svg.html")
	require.NoError(t, err)
	var buf bytes.Buffer
	require.NoError(t, tmpl.ExecuteTemplate(&buf, "timeline", tl))
	dec := xml.NewDecoder(bytes.NewReader(buf.Bytes()))
	for {
		_, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "the SVG is well-formed XML:\n%s", buf.String())
	}
	return buf.String()
}

func TestNiceStep(t *testing.T) {
	for rough, want := range map[float64]float64{0.7: 1, 1: 1, 1.2: 2, 3: 5, 7: 10, 114.75: 200, 0.013: 0.02, 2500: 5000} {
		assert.InDelta(t, want, niceStep(rough), want*1e-9, "%v", rough)
	}
}

// A command found waiting in this database is marked where it was found;
// a saga that timed out closes its action's bar as given up on.
func TestTimelinePictureOfAWaitAndATimeout(t *testing.T) {
	finished := at(900)
	in := saga.Instance{ID: uuid.New(), Status: saga.StatusCompensated, CreatedAt: t0, FinishedAt: &finished, History: []saga.HistoryEntry{
		entry(1, "started", "", "", 0),
		entry(2, "sent", "ship", saga.PhaseAction, 1),
		entry(300, "waiting", "ship", saga.PhaseAction, 1),
		entry(600, "timed_out", "ship", saga.PhaseAction, 1),
		entry(600, "compensated", "", "", 0),
	}}
	tl := buildTimeline(in, at(5000))
	require.NotNil(t, tl)
	require.Len(t, tl.Bars, 1)
	assert.Equal(t, "gave_up", tl.Bars[0].Outcome)
	assert.Contains(t, tl.Bars[0].Title, "the saga timed out")
	require.Len(t, tl.Marks, 1)
	assert.Contains(t, tl.Marks[0].Title, "not left this database yet")
}
