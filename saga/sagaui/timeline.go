package sagaui

// A saga's timeline as a picture: the geometry of an inline SVG, computed
// here and drawn by web/timeline.svg.html. One lane per step the timeline
// names (in the order it first names them), the action's commands on the
// lane's upper row and the compensation's on the lower one; a bar runs
// from a command sent to its reply, ends with a mark for the reply (ok,
// failed) or for giving up, and carries marks where it was sent again.

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/pgsaga/pgsaga/internal/present"
	"github.com/pgsaga/pgsaga/saga"
)

type svgTimeline struct {
	Width, Height         float64
	PlotLeft, PlotRight   float64
	LanesTop, LanesBottom float64
	Lanes                 []svgLane
	Ticks                 []svgTick
	Bars                  []svgBar
	Marks                 []svgMark
	Events                []svgEvent
	AxisTitle             string
	LegendY               float64
}

type svgLane struct {
	Name, Label, LabelTitle string
	Y, H, LabelY            float64
	ActionY, CompY          float64
	ActionH, CompH          float64
	Shaded                  bool
}

type svgTick struct {
	X     float64
	Label string
}

type svgBar struct {
	Step, Phase   string
	Outcome       string // ok, failed, gave_up, cancelled, superseded, open
	X, Y, W, H    float64
	EndX, MidY    float64
	EndPath       string
	Title         string
	Label         string
	LabelX        float64
	LabelAnchor   string // start, middle (inside the bar), end
	Attempt       int
	start, end    time.Time
	resends, lane int
}

type svgMark struct {
	Kind, Points, Title string
}

type svgEvent struct {
	Kind, Label, Anchor string
	X, LabelX           float64
	Title               string
}

const (
	tlWidth     = 1000.0
	tlPlotLeft  = 150.0
	tlPlotRight = 970.0
	tlHeader    = 34.0
	tlLaneH     = 50.0
	tlRowH      = 14.0
)

// buildTimeline lays out in's timeline; now ends the bars of commands not
// answered yet.
func buildTimeline(in saga.Instance, now time.Time) *svgTimeline {
	if len(in.History) == 0 {
		return nil
	}
	t0 := in.CreatedAt
	end := t0
	for _, h := range in.History {
		if h.At.After(end) {
			end = h.At
		}
	}
	if in.FinishedAt != nil && in.FinishedAt.After(end) {
		end = *in.FinishedAt
	}

	// Lanes, in the order the timeline first names their steps.
	laneOf := map[string]int{}
	var lanes []svgLane
	for _, h := range in.History {
		if h.Step == "" {
			continue
		}
		if _, ok := laneOf[h.Step]; !ok {
			laneOf[h.Step] = len(lanes)
			lanes = append(lanes, svgLane{Name: h.Step})
		}
	}

	// Bars: from a command sent to what answered it.
	type key struct{ step, phase string }
	open := map[key]int{}
	var bars []svgBar
	type pointMark struct {
		kind  string
		at    time.Time
		lane  int
		phase string
		title string
	}
	var points []pointMark
	var events []svgEvent
	eventAt := []time.Time{}
	closeBar := func(k key, at time.Time, outcome string) bool {
		i, ok := open[k]
		if !ok {
			return false
		}
		bars[i].end, bars[i].Outcome = at, outcome
		delete(open, k)
		return true
	}
	for _, h := range in.History {
		k := key{h.Step, string(h.Phase)}
		lane := laneOf[h.Step]
		label := fmt.Sprintf("%s · %s · attempt %d", h.Step, h.Phase, h.Attempt)
		switch h.Kind {
		case "sent":
			closeBar(k, h.At, "superseded")
			open[k] = len(bars)
			bars = append(bars, svgBar{Step: h.Step, Phase: string(h.Phase), Attempt: h.Attempt, start: h.At, lane: lane,
				Title: label + "\nsent " + sinceStart(h.At, t0) + ": " + h.Detail})
		case "resent":
			if i, ok := open[k]; ok {
				bars[i].resends++
				bars[i].Attempt = h.Attempt
			} else {
				open[k] = len(bars)
				bars = append(bars, svgBar{Step: h.Step, Phase: string(h.Phase), Attempt: h.Attempt, start: h.At, lane: lane,
					Title: label + "\nsent " + sinceStart(h.At, t0) + ": " + h.Detail})
			}
			points = append(points, pointMark{"resent", h.At, lane, k.phase, label + "\nsent again " + sinceStart(h.At, t0)})
		case "reply_ok", "reply_failed":
			outcome := "ok"
			if h.Kind == "reply_failed" {
				outcome = "failed"
			}
			if i, ok := open[k]; ok {
				bars[i].Title += "\n" + h.Kind + " " + sinceStart(h.At, t0) + withDetail(h.Detail)
			}
			closeBar(k, h.At, outcome)
		case "deadline":
			points = append(points, pointMark{"deadline", h.At, lane, k.phase, label + "\ndeadline passed " + sinceStart(h.At, t0) + withDetail(h.Detail)})
		case "waiting":
			points = append(points, pointMark{"deadline", h.At, lane, k.phase, label + "\nnot left this database yet " + sinceStart(h.At, t0) + withDetail(h.Detail)})
		case "gave_up", "timed_out":
			what := "gave up "
			if h.Kind == "timed_out" {
				what = "the saga timed out "
			}
			if i, ok := open[k]; ok {
				bars[i].Title += "\n" + what + sinceStart(h.At, t0) + withDetail(h.Detail)
			}
			closeBar(k, h.At, "gave_up")
		case "cancelled":
			if i, ok := open[k]; ok {
				bars[i].Title += "\ncancelled " + sinceStart(h.At, t0) + withDetail(h.Detail)
			}
			closeBar(k, h.At, "cancelled")
			if h.Step != "" {
				points = append(points, pointMark{"cancelled", h.At, lane, k.phase, "cancelled " + sinceStart(h.At, t0) + withDetail(h.Detail)})
			}
		case "retried":
			if h.Step != "" {
				points = append(points, pointMark{"retried", h.At, lane, k.phase, label + "\noperator retry " + sinceStart(h.At, t0)})
			}
		case "failed":
			closeBar(k, h.At, "gave_up")
			events = append(events, svgEvent{Kind: "failed", Label: "failed (parked) " + sinceStart(h.At, t0), Title: h.Detail})
			eventAt = append(eventAt, h.At)
		case "started", "completed", "compensated":
			label := h.Kind
			if h.Kind != "started" {
				label += " " + sinceStart(h.At, t0)
			}
			events = append(events, svgEvent{Kind: h.Kind, Label: label, Title: h.Kind + " " + sinceStart(h.At, t0) + withDetail(h.Detail)})
			eventAt = append(eventAt, h.At)
		}
	}
	barEnd := end
	if len(open) > 0 && !in.Status.Terminal() && now.After(barEnd) {
		barEnd = now
		end = now
	}
	for k, i := range open {
		bars[i].end = barEnd
		if in.Status.Terminal() {
			bars[i].Outcome = "superseded"
		} else {
			bars[i].Outcome = "open"
			bars[i].Title += "\nno reply yet"
		}
		delete(open, k)
	}

	// Scale.
	total := end.Sub(t0).Seconds() * 1000 // ms
	if total < 1 {
		total = 1
	}
	full := total * 1.02
	x := func(t time.Time) float64 {
		return tlPlotLeft + (t.Sub(t0).Seconds()*1000)/full*(tlPlotRight-tlPlotLeft)
	}
	tl := &svgTimeline{Width: tlWidth, PlotLeft: tlPlotLeft, PlotRight: tlPlotRight, LanesTop: tlHeader}
	for i := range lanes {
		l := &lanes[i]
		l.Y, l.H = tlHeader+float64(i)*tlLaneH, tlLaneH
		l.LabelY = l.Y + tlLaneH/2 + 4.5
		l.ActionY, l.CompY = l.Y+8, l.Y+8+tlRowH+6
		l.ActionH, l.CompH = tlRowH, tlRowH
		l.Shaded = i%2 == 0
		l.Label, l.LabelTitle = present.Clip(l.Name, 18), l.Name
	}
	tl.LanesBottom = tlHeader + float64(len(lanes))*tlLaneH
	if len(lanes) == 0 {
		tl.LanesBottom = tlHeader + 24
	}
	tl.Height = tl.LanesBottom + 100
	tl.LegendY = tl.LanesBottom + 64

	// Axis: 1, 2 or 5 times a power of ten, about eight ticks.
	unit, div := "ms", 1.0
	switch {
	case total >= 10*3600_000:
		unit, div = "h", 3600_000
	case total >= 10*60_000:
		unit, div = "min", 60_000
	case total >= 10_000:
		unit, div = "s", 1000
	}
	step := niceStep(full / div / 8)
	decimals := 0
	if step < 1 {
		decimals = int(math.Ceil(-math.Log10(step) - 1e-9))
	}
	for i := 0; float64(i)*step <= full/div+1e-9; i++ {
		v := float64(i) * step
		tl.Ticks = append(tl.Ticks, svgTick{X: tlPlotLeft + v*div/full*(tlPlotRight-tlPlotLeft), Label: strconv.FormatFloat(v, 'f', decimals, 64)})
	}
	tl.AxisTitle = "time since the saga started (" + unit + ")"

	// Bars, with their end marks and durations.
	for i := range bars {
		b := &bars[i]
		l := lanes[b.lane]
		b.Y, b.H = l.ActionY, l.ActionH
		if b.Phase == string(saga.PhaseCompensation) {
			b.Y, b.H = l.CompY, l.CompH
		}
		b.X = x(b.start)
		b.EndX = x(b.end)
		b.W = math.Max(b.EndX-b.X, 3)
		b.EndX = b.X + b.W
		b.MidY = b.Y + b.H/2
		b.EndPath = endGlyph(b.Outcome, b.EndX, b.MidY)
		b.Label = span(b.end.Sub(b.start))
		if b.resends > 0 {
			b.Label += fmt.Sprintf(" · %d sends", b.resends+1)
		}
	}
	// A bar's duration goes right of it if its row has room there, else
	// inside it, else left of it, else nowhere.
	for i := range bars {
		b := &bars[i]
		textW := 6.0 * float64(len([]rune(b.Label)))
		right, left := tlWidth-4, tlPlotLeft+2
		for j, o := range bars {
			if j == i || o.lane != b.lane || o.Phase != b.Phase {
				continue
			}
			if j > i && o.X < right {
				right = o.X - 4
			}
			if j < i && o.EndX+8 > left {
				left = o.EndX + 8
			}
		}
		gap := 4.0
		if b.EndPath != "" || b.Outcome == "cancelled" {
			gap = 10
		}
		switch {
		case b.EndX+gap+textW <= right:
			b.LabelX, b.LabelAnchor = b.EndX+gap, "start"
		case b.W >= textW+24:
			b.LabelX, b.LabelAnchor = b.X+(b.W-6)/2, "middle"
		case b.X-4-textW >= left:
			b.LabelX, b.LabelAnchor = b.X-4, "end"
		default:
			b.Label = ""
		}
	}
	tl.Bars = bars
	for _, p := range points {
		l := lanes[p.lane]
		rowY := l.ActionY
		if p.phase == string(saga.PhaseCompensation) {
			rowY = l.CompY
		}
		px := x(p.at)
		m := svgMark{Kind: p.kind, Title: p.title}
		switch p.kind {
		case "resent", "retried": // a triangle pointing down at the row
			m.Points = pts(px-4.5, rowY-6, px+4.5, rowY-6, px, rowY+1)
		default: // a diamond on the row
			cy := rowY + tlRowH/2
			m.Points = pts(px, cy-6.5, px+6.5, cy, px, cy+6.5, px-6.5, cy)
		}
		tl.Marks = append(tl.Marks, m)
	}
	for i := range events {
		e := &events[i]
		e.X = x(eventAt[i])
		if e.X > (tlPlotLeft+tlPlotRight)/2 {
			e.Anchor, e.LabelX = "end", e.X-4
		} else {
			e.Anchor, e.LabelX = "start", e.X+4
		}
	}
	tl.Events = events
	tl.Lanes = lanes
	return tl
}

// niceStep is the least of 1, 2, 5 times a power of ten not below rough.
func niceStep(rough float64) float64 {
	if rough <= 0 {
		return 1
	}
	mag := math.Pow(10, math.Floor(math.Log10(rough)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*mag >= rough*(1-1e-9) {
			return m * mag
		}
	}
	return 10 * mag
}

// endGlyph is the path drawn in a bar's end mark: a check for a reply ok,
// a cross for a failure or giving up; none for a command cancelled (the
// cancel has a mark of its own), or still (or never) answered.
func endGlyph(outcome string, cx, cy float64) string {
	switch outcome {
	case "ok":
		return fmt.Sprintf("M%.1f %.1fL%.1f %.1fL%.1f %.1f", cx-2.7, cy+0.2, cx-0.8, cy+2.2, cx+2.8, cy-2.1)
	case "failed", "gave_up":
		return fmt.Sprintf("M%.1f %.1fL%.1f %.1fM%.1f %.1fL%.1f %.1f", cx-2.3, cy-2.3, cx+2.3, cy+2.3, cx+2.3, cy-2.3, cx-2.3, cy+2.3)
	}
	return "" // a cancel has its own mark
}

func pts(xy ...float64) string {
	var b strings.Builder
	for i := 0; i+1 < len(xy); i += 2 {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%.1f,%.1f", xy[i], xy[i+1])
	}
	return b.String()
}

func sinceStart(at, t0 time.Time) string {
	return "+" + span(at.Sub(t0))
}

// span is a short duration for people: 12.3 ms, 4.56 s, 3m05s.
func span(d time.Duration) string {
	switch {
	case d < time.Second:
		return ms(d)
	case d < time.Minute:
		return strconv.FormatFloat(d.Seconds(), 'f', 2, 64) + " s"
	}
	return present.Age(d)
}

func withDetail(d string) string {
	if d == "" {
		return ""
	}
	return ": " + d
}
